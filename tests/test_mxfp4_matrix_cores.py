"""Where a route from JAX reaches MI355X's native MXFP4 matrix cores (the released model's expert format), and
what it asks of the layer.

``jax.nn.scaled_matmul`` of ``float4_e2m1fn`` codes with ``float8_e8m0fnu`` scales, one per 32 values along K
(the operands' layout [batch, rows, K] with K minor, the checkpoint's own [out, in/2] layout), is read from the
code object XLA compiles for it on a deviceless topology (``tests/machine_code.py``): on gfx950 it runs the
block-scaled MFMA ``v_mfma_scale_f32_*_f8f6f4``, on gfx942 (no FP4 matrix instruction) bf16 MFMAs on decoded
values; with jax 0.12 (jax 0.10.2's XLA cannot lower it for ROCm). It reads the codes in place only in the
checkpoint's layout (the layer's own layout costs a transposed copy), and with FP8 activations it becomes
hipBLASLt's block-scaled GEMM, a library call. Both operands are at most 8 bits: the layer's bf16 activations
would have to be quantised, so its experts do not take this route (``k3_tail.models.kimi_k3.mxfp4_experts.mxfp4_path``;
docs/kimi_k3.md, MXFP4 routed experts): this pins that it exists and what it costs.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import machine_code
from helpers import disassembled, gpu_mesh_for, topology_params

pytestmark = pytest.mark.compiled
# Measured: jax 0.10.2's XLA fails to lower the scaled-dot fusion of two FP4 operands for ROCm ("Failed to lower from
# shared dialect to Triton") on both processors; jax 0.12's compiles it.
FP4_PRODUCT_LOWERS = pytest.mark.xfail(jax.__version_info__ < (0, 11), raises=jax.errors.JaxRuntimeError, strict=True,
                                       reason="jax 0.10's XLA cannot lower a block-scaled FP4 dot for ROCm")

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
    processor, text = disassembled(machine_code.disassembly, image)
    assert processor == PROCESSORS[topology]
    return set(re.findall(r"\bv_mfma\w*", text))


@FP4_PRODUCT_LOWERS
@pytest.mark.parametrize("topology", topology_params("mi355xx8"))
def test_on_gfx950_the_block_scaled_product_runs_the_native_mxfp4_instruction(topology):
    assert any(name.startswith("v_mfma_scale_f32_") and name.endswith("_f8f6f4") for name in
               matrix_instructions(topology))


@FP4_PRODUCT_LOWERS
@pytest.mark.parametrize("topology", topology_params("mi300xx8"))
def test_on_gfx942_it_multiplies_decoded_values_in_bf16(topology):
    names = matrix_instructions(topology)
    assert names and not any(name.startswith("v_mfma_scale") for name in names)
    assert any(name.endswith("bf16") for name in names)


def block_scaled_product(topology, lhs_dtype, codes_layout):
    """One expert group's gate GEMM at prefill (56 experts, 46 rows, K = 3584, 384 columns) as a block-scaled
    product of ``lhs_dtype`` activations (E8M0 scales per 32) and MXFP4 weights held packed in ``codes_layout``:
    "checkpoint" [experts, N, K/2] (K minor, as compressed-tensors stores it) or "flax" [experts, K/2, N] (the
    layer's), compiled for ``topology``."""
    if not hasattr(jnp, "float4_e2m1fn") or not hasattr(jax.nn, "scaled_matmul"):
        pytest.skip(f"jax {jax.__version__} has no float4_e2m1fn or jax.nn.scaled_matmul")
    experts, rows, columns = 56, 46, 384
    device = gpu_mesh_for(topology).devices.flat[0]
    sharding = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    stored = (experts, columns, DEPTH // 2) if codes_layout == "checkpoint" else (experts, DEPTH // 2, columns)
    scales = (experts, columns, DEPTH // GROUP) if codes_layout == "checkpoint" else (experts, DEPTH // GROUP, columns)

    def product(rows_values, rows_scales, packed, scale):
        if codes_layout == "flax":
            packed, scale = jnp.swapaxes(packed, 1, 2), jnp.swapaxes(scale, 1, 2)
        codes = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn).reshape(experts, columns, DEPTH)
        return jax.nn.scaled_matmul(rows_values, codes, rows_scales,
                                    jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu),
                                    preferred_element_type=jnp.float32)

    arguments = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in (
        ((experts, rows, DEPTH), lhs_dtype), ((experts, rows, DEPTH // GROUP), jnp.float8_e8m0fnu),
        (stored, jnp.uint8), (scales, jnp.uint8))]
    return jax.jit(product).lower(*arguments).compile()


@FP4_PRODUCT_LOWERS
@pytest.mark.parametrize("topology", topology_params("mi355xx8"))
def test_the_native_route_reads_the_codes_in_place_only_in_the_checkpoints_own_layout(topology):
    in_place = block_scaled_product(topology, jnp.float4_e2m1fn, "checkpoint")
    assert in_place.memory_analysis().temp_size_in_bytes == 0
    (image,) = machine_code.code_objects(in_place)
    # In the layer's layout XLA first writes the group's codes transposed, K minor: 56 x 384 x 3584 / 2 bytes.
    transposed = block_scaled_product(topology, jnp.float4_e2m1fn, "flax")
    assert transposed.memory_analysis().temp_size_in_bytes == 56 * 384 * DEPTH // 2
    assert len(machine_code.code_objects(transposed)) == 2


@pytest.mark.parametrize("topology", topology_params("mi355xx8"))
def test_fp8_activations_with_fp4_weights_are_a_hipblaslt_library_call(topology):
    compiled = block_scaled_product(topology, jnp.float8_e4m3fn, "checkpoint")
    # Both jax versions: hipBLASLt's block-scaled GEMM, whose instructions no deviceless compile shows.
    assert 'custom_call_target="__cublas$lt$matmul$mx"' in compiled.as_text()
