"""Where a route from JAX reaches MI355X's native MXFP4 matrix cores (the released model's expert format).

``jax.nn.scaled_matmul`` of ``float4_e2m1fn`` codes with ``float8_e8m0fnu`` scales, one per 32 values along K
(the operands' layout [batch, rows, K] with K minor, the checkpoint's own [out, in/2] layout), is read from the
code object XLA compiles for it on a deviceless topology (``k3_tail.xla.machine_code``): on gfx950 it runs the
block-scaled MFMA ``v_mfma_scale_f32_*_f8f6f4``, on gfx942 (no FP4 matrix instruction) bf16 MFMAs on decoded
values; with jax 0.12 (jax 0.10.2's XLA cannot lower it for ROCm). The layer's experts do not take this route
yet (docs/guide.md, MXFP4 experts): this pins that it exists.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import gpu_mesh_for, topology_params
from k3_tail.xla import machine_code

pytestmark = [
    pytest.mark.compiled,
    # Measured: jax 0.10.2's XLA fails to lower the scaled-dot fusion for ROCm ("Failed to lower from shared dialect
    # to Triton") on both processors; jax 0.12's compiles it.
    pytest.mark.xfail(jax.__version_info__ < (0, 11), raises=jax.errors.JaxRuntimeError, strict=True,
                      reason="jax 0.10's XLA cannot lower a block-scaled FP4 dot for ROCm"),
]

# One routed expert's down projection at decode: 16 tokens, K = 3584 (the latent), 1536 output columns.
ROWS, DEPTH, COLUMNS, GROUP = 16, 3584, 1536, 32
PROCESSORS = {"mi300xx8": "gfx942", "mi355xx8": "gfx950"}


def matrix_instructions(topology):
    """The MFMA mnemonics in the code object of one block-scaled FP4 product compiled for ``topology``."""
    if not hasattr(jnp, "float4_e2m1fn") or not hasattr(jax.nn, "scaled_matmul"):
        pytest.skip(f"jax {jax.__version__} has no float4_e2m1fn or jax.nn.scaled_matmul")
    device = gpu_mesh_for(topology).devices.flat[0]
    sharding = NamedSharding(Mesh(np.array([device]), ("x",)), P())

    def operand(rows, width, dtype):
        return jax.ShapeDtypeStruct((1, rows, width), dtype, sharding=sharding)

    codes, scales = jnp.float4_e2m1fn, jnp.float8_e8m0fnu
    arguments = (operand(ROWS, DEPTH, codes), operand(COLUMNS, DEPTH, codes), operand(ROWS, DEPTH // GROUP, scales),
                 operand(COLUMNS, DEPTH // GROUP, scales))
    product = jax.jit(lambda a, b, a_scale, b_scale: jax.nn.scaled_matmul(
        a, b, a_scale, b_scale, preferred_element_type=jnp.float32))
    compiled = product.lower(*arguments).compile()
    (image,) = machine_code.code_objects(compiled)
    try:
        processor, text = machine_code.disassembly(image)
    except machine_code.DisassemblerUnavailable as missing:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(missing))
    assert processor == PROCESSORS[topology]
    return set(re.findall(r"\bv_mfma\w*", text))


@pytest.mark.parametrize("topology", topology_params("mi355xx8"))
def test_on_gfx950_the_block_scaled_product_runs_the_native_mxfp4_instruction(topology):
    assert any(name.startswith("v_mfma_scale_f32_") and name.endswith("_f8f6f4") for name in
               matrix_instructions(topology))


@pytest.mark.parametrize("topology", topology_params("mi300xx8"))
def test_on_gfx942_it_multiplies_decoded_values_in_bf16(topology):
    names = matrix_instructions(topology)
    assert names and not any(name.startswith("v_mfma_scale") for name in names)
    assert any(name.endswith("bf16") for name in names)
