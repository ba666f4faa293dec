"""The batched GEMM over MXFP4 kernels that decodes in its operand load (k3_tail/models/kimi_k3/mxfp4_matmul.py).

On the CPU the kernel runs in Pallas's interpret mode, the same kernel with its programs in turn; it is held
against a float64 product of the same operands (ml_dtypes' decoding, tests/mxfp4_fixture.py), within the bound
of float32 accumulation: |y - exact| <= 2 K 2^-24 (|x| @ |W|) (each product is exact in float32, K additions
each rounding once). Compiled for the deviceless GPU targets it is one kernel, writes nothing else, and
multiplies on the matrix units, read from its machine code.
"""

import functools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import machine_code
import mxfp4_fixture
from helpers import command_environment, disassembled, gpu_mesh_for, topology_params
from k3_tail.models.kimi_k3 import mxfp4_experts as kimi_k3_mxfp4, routed_experts
from k3_tail.models.kimi_k3.mxfp4_matmul import mxfp4_matmul, mxfp4_matmul_reference, row_tile

FLOAT32_UNIT = 2.0 ** -24


def operands(kernels, rows, depth, columns, *, dtype=jnp.bfloat16, scales=(118, 122), seed=0):
    """(rows [S, C, K] of ``dtype``, packed uint8 [S, K/2, N], scale uint8 [S, K/32, N]): random normal rows,
    random codes, scales drawn from ``scales`` (inclusive)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((kernels, rows, depth)), dtype)
    packed = rng.integers(0, 256, (kernels, depth // 2, columns), dtype=np.uint8)
    scale = rng.integers(scales[0], scales[1] + 1, (kernels, depth // 32, columns), dtype=np.uint8)
    return x, packed, scale


def exact_weights(packed, scale):
    """float64 [S, K, N] of ``packed`` [S, K/2, N] and ``scale`` [S, K/32, N] (the fixture's [..., in] decoder)."""
    return np.swapaxes(mxfp4_fixture.decode(np.swapaxes(packed, 1, 2), np.swapaxes(scale, 1, 2)), 1, 2)


def assert_within_float32_accumulation(result, x, packed, scale):
    x = np.asarray(x, np.float64)
    weights = exact_weights(packed, scale)
    exact = x @ weights
    bound = 2 * x.shape[-1] * FLOAT32_UNIT * (np.abs(x) @ np.abs(weights))
    result = np.asarray(result, np.float64)
    assert result.dtype == np.float64 and result.shape == exact.shape
    assert np.all(np.abs(result - exact) <= bound), np.max(np.abs(result - exact) - bound)


@pytest.mark.parametrize(("dtype", "kernels", "rows", "depth", "columns"), [
    (jnp.bfloat16, 2, 5, 96, 80),     # rows and columns short of a tile; three groups
    (jnp.float32, 1, 17, 64, 64),     # a row tile of 32, rows past 16; float32 products
    (jnp.bfloat16, 3, 1, 32, 130),    # one row, one group, three column tiles
])
def test_the_kernel_computes_the_decoded_product_within_float32_accumulation(dtype, kernels, rows, depth, columns):
    x, packed, scale = operands(kernels, rows, depth, columns, dtype=dtype)
    result = mxfp4_matmul(x, jnp.asarray(packed), jnp.asarray(scale), interpret=True)
    assert result.dtype == jnp.float32
    assert_within_float32_accumulation(result, x, packed, scale)


def test_the_kernels_are_picked_by_index_in_any_order_and_repeated():
    x, packed, scale = operands(3, 5, 64, 48)
    picked = np.array([2, 0, 2])
    result = mxfp4_matmul(x, jnp.asarray(packed), jnp.asarray(scale), kernels=jnp.asarray(picked), interpret=True)
    assert_within_float32_accumulation(result, x, packed[picked], scale[picked])


def test_an_index_outside_the_kernels_gives_its_block_nan_and_leaves_the_others_alone():
    x, packed, scale = operands(3, 5, 64, 48)
    picked = jnp.array([1, 3, -1])
    for product in (functools.partial(mxfp4_matmul, interpret=True), mxfp4_matmul_reference):
        result = np.asarray(product(x, jnp.asarray(packed), jnp.asarray(scale), kernels=picked))
        assert np.isnan(result[1:]).all() and np.isfinite(result[0]).all()


def test_the_reference_is_the_same_function():
    x, packed, scale = operands(2, 5, 96, 80)
    assert_within_float32_accumulation(mxfp4_matmul_reference(x, jnp.asarray(packed), jnp.asarray(scale)), x,
                                       packed, scale)


@pytest.mark.parametrize("u", [0, 1, 2, 252])
def test_each_weight_is_the_references_at_the_ends_of_the_scale_range(u):
    # One-hot rows pick row 3 of K: each output is one product, weight times 1, so no order of additions enters.
    # u = 0 and 1 make subnormal weights, which the backend's float products may flush (XLA:CPU's do, the
    # interpreted kernel's and the reference's alike); u = 252 values up to 6 * 2^125.
    _, packed, scale = operands(1, 2, 64, 16, dtype=jnp.float32, scales=(u, u))
    x = jnp.broadcast_to(jnp.where(jnp.arange(64) == 3, 1.0, 0.0).astype(jnp.float32), (1, 2, 64))
    result = np.asarray(mxfp4_matmul(x, jnp.asarray(packed), jnp.asarray(scale), interpret=True))
    reference = np.asarray(mxfp4_matmul_reference(x, jnp.asarray(packed), jnp.asarray(scale)))
    assert np.array_equal(result, reference)
    if u >= 2:  # normal weights: exactly the format's values
        assert np.array_equal(result[0, 0], exact_weights(packed, scale)[0, 3].astype(np.float32))


def test_a_nan_scale_reaches_exactly_the_outputs_of_its_column_and_an_overflowing_one_is_infinite():
    x, packed, scale = operands(1, 3, 64, 16)
    scale[0, 1, 5] = 255                      # NaN: every weight of column 5's second group
    packed[0, :, 9] = 0x77                    # codes of 6 in column 9 ...
    scale[0, :, 9] = 254                      # ... times 2^127: past float32's largest, +inf
    x = jnp.abs(x)                            # so that column 9's infinite products do not cancel
    result = np.asarray(mxfp4_matmul(x, jnp.asarray(packed), jnp.asarray(scale), interpret=True))
    assert np.isnan(result[0, :, 5]).all()
    assert np.isposinf(result[0, :, 9]).all()
    others = np.delete(result[0], [5, 9], axis=1)
    assert np.isfinite(others).all()


def test_empty_batches_rows_and_columns_give_empty_results():
    for kernels, rows, columns in ((0, 3, 16), (2, 0, 16), (2, 3, 0)):
        x, packed, scale = operands(kernels, rows, 32, columns)
        assert mxfp4_matmul(x, jnp.asarray(packed), jnp.asarray(scale), interpret=True).shape == (kernels, rows,
                                                                                                 columns)


@pytest.mark.parametrize(("rows", "tile"), [(1, 16), (16, 16), (17, 32), (46, 64), (64, 64), (200, 64)])
def test_a_row_tile_is_the_power_of_two_at_or_above_the_rows_within_16_to_64(rows, tile):
    assert row_tile(rows) == tile


@pytest.mark.parametrize(("change", "message"), [
    (lambda x, p, s: (x.astype(jnp.float16), p, s), "rows: expected"),
    (lambda x, p, s: (x[..., :48], p, s), "rows: K must be a multiple of 32"),
    (lambda x, p, s: (x, p[:, :-1], s), r"packed: expected uint8 \[E, 48, N\]"),
    (lambda x, p, s: (x, p.astype(np.int8), s), "packed: expected uint8"),
    (lambda x, p, s: (x, p, s[:, :, :-1]), r"scale: expected 2 kernels of 80 columns"),
    (lambda x, p, s: (x, p[:1], s[:1]), "kernels: None multiplies kernel s by rows"),
])
def test_bad_operands_are_a_value_error_naming_the_argument(change, message):
    x, packed, scale = change(*operands(2, 5, 96, 80))
    with pytest.raises(ValueError, match=message):
        mxfp4_matmul(x, jnp.asarray(packed), jnp.asarray(scale), interpret=True)


def test_indices_of_another_shape_are_a_value_error_naming_kernels():
    x, packed, scale = operands(2, 5, 96, 80)
    with pytest.raises(ValueError, match=r"kernels: expected integers \[2\]"):
        mxfp4_matmul(x, jnp.asarray(packed), jnp.asarray(scale), kernels=jnp.zeros(3, jnp.int32), interpret=True)


PRODUCTS = {"kernel": functools.partial(mxfp4_matmul, interpret=True), "reference": mxfp4_matmul_reference}


@pytest.mark.parametrize("product", PRODUCTS)
def test_a_concrete_index_int32_cannot_hold_is_refused_naming_kernels(product):
    """Cast to int32 first, 2^32 + 1 would be kernel 1 and its product returned."""
    x, packed, scale = operands(2, 5, 64, 48)
    with pytest.raises(ValueError, match=r"^kernels: expected indices int32 can hold .* got 4294967297 at position 1"):
        PRODUCTS[product](x, jnp.asarray(packed), jnp.asarray(scale), kernels=np.array([0, 2**32 + 1]))


@pytest.mark.parametrize("product", PRODUCTS)
def test_a_traced_int64_index_past_the_kernels_gives_nan_not_a_wrapped_kernel(product):
    x, packed, scale = operands(2, 5, 64, 48)
    with jax.enable_x64(True):
        result = jax.jit(lambda k: PRODUCTS[product](x, jnp.asarray(packed), jnp.asarray(scale), kernels=k))(
            np.array([0, 2**32 + 1], np.int64))
    assert np.isfinite(result[0]).all() and np.isnan(result[1]).all()


# Each operand given as a non-array once, each kind of non-array once (a covering, not the product).
@pytest.mark.parametrize(("argument", "value"), [("rows", [[1.0]]), ("packed", b"\x00"), ("scale", None),
                                                 ("kernels", "0,1")])
def test_an_operand_that_is_no_array_is_a_value_error_naming_it(argument, value):
    x, packed, scale = operands(2, 5, 64, 48)
    operands_by_name = {"rows": x, "packed": jnp.asarray(packed), "scale": jnp.asarray(scale), "kernels": None,
                        argument: value}
    kernels = operands_by_name.pop("kernels")
    with pytest.raises(ValueError, match=rf"^{argument}: expected .*, got (None|a \w+ \(not an array)"):
        mxfp4_matmul(*operands_by_name.values(), kernels=kernels, interpret=True)


@pytest.mark.parametrize("product", PRODUCTS)
def test_no_depth_gives_the_empty_sum_and_no_kernels_nan(product):
    """K = 0: 0 where the index is a kernel, NaN where it is not; E = 0: no index is a kernel."""
    x, packed, scale = operands(2, 3, 0, 16)
    result = np.asarray(PRODUCTS[product](x, jnp.asarray(packed), jnp.asarray(scale), kernels=jnp.array([1, 2])))
    assert result.shape == (2, 3, 16) and (result[0] == 0).all() and np.isnan(result[1]).all()
    x, packed, scale = operands(2, 3, 32, 16)
    result = PRODUCTS[product](x, jnp.asarray(packed[:0]), jnp.asarray(scale[:0]), kernels=jnp.array([0, 1]))
    assert result.shape == (2, 3, 16) and np.isnan(result).all()


def test_the_gradient_with_respect_to_the_rows_is_the_references():
    x, packed, scale = operands(2, 5, 64, 48, dtype=jnp.float32)
    picked = jnp.array([1, 0])

    def loss(product):
        return jax.grad(lambda rows: jnp.sum(jnp.sin(product(rows, jnp.asarray(packed), jnp.asarray(scale),
                                                             kernels=picked))))(x)

    np.testing.assert_allclose(loss(PRODUCTS["kernel"]), loss(mxfp4_matmul_reference), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call", ["mxfp4_matmul", "Mxfp4Kernel.matmul"])
def test_interpreted_inside_a_shard_map_that_types_its_values_it_computes_what_it_does_outside(call):
    """Rows and indices split over 8 devices, the kernels replicated, check_vma=True: Pallas's interpreter takes
    no varying value, so each device runs every device's call (k3_tail.ops.pallas_triton.interpreted)."""
    x, packed, scale = operands(8, 3, 64, 48)
    picked = jnp.array([7, 0, 3, 3, 5, 1, 6, 2], jnp.int32)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    if call == "mxfp4_matmul":
        def product(rows, packed, scale, kernels):
            return mxfp4_matmul(rows, packed, scale, kernels=kernels, interpret=True)
    else:
        def product(rows, packed, scale, kernels):
            return kimi_k3_mxfp4.Mxfp4Kernel(packed, scale, kernels).matmul(rows, interpret=True)
    split, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    mapped = jax.shard_map(product, mesh=mesh, in_specs=(P("x"), P(), P(), P("x")), out_specs=P("x"))
    result = mapped(jax.device_put(x, split), jax.device_put(packed, whole), jax.device_put(scale, whole),
                    jax.device_put(picked, split))
    np.testing.assert_array_equal(result, product(x, jnp.asarray(packed), jnp.asarray(scale), picked))


KERNEL = "k3_tail_mxfp4_matmul"
# The matrix instruction each target's code multiplies the decoded weights with (bf16 operands).
MATRIX_INSTRUCTIONS = {"sm_90": r"\bH[G]?MMA\.\S*BF16", "gfx942": r"^v_mfma_f32_\w+_bf16\b",
                       "gfx950": r"^v_mfma_f32_\w+_bf16\b"}


@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8", "mi355xx8"))
def test_compiled_it_is_one_kernel_with_no_scratch_that_multiplies_on_the_matrix_units(topology):
    # One group of the capacity method's gate kernels at prefill: 56 experts, 46 rows, K = 3584, 384 columns.
    device = gpu_mesh_for(topology).devices.flat[0]
    mesh = Mesh(np.array([device]), ("x",))
    shapes = (((56, 46, 3584), jnp.bfloat16), ((56, 1792, 384), jnp.uint8), ((56, 112, 384), jnp.uint8))
    arguments = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P())) for shape, dtype in shapes]
    # Under shard_map, as in the layer: Pallas reads the target GPU from the mesh of the program it lowers in.
    product = jax.shard_map(mxfp4_matmul, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())
    # At XLA's default LLVM level, which the suite's fast compiles lower to 0 (no ROCm code object at level 0).
    compiled = jax.jit(product).lower(*arguments).compile(compiler_options={"xla_backend_optimization_level": 2})
    entry = compiled.as_text().split("ENTRY", 1)[1]
    assert len(re.findall(r"= \S+ custom-call\(", entry)) == 1 and " fusion(" not in entry
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    code = disassembled(machine_code.kernel_code, compiled, KERNEL)
    pattern = MATRIX_INSTRUCTIONS[code.processor.rstrip("a")]  # sm_90a: sm_90's architecture-specific features
    assert any(re.search(pattern, instruction) for instruction in code.instructions)



def test_the_benchmark_checks_and_times_both_on_the_cpu_interpreted(tmp_path):
    """scripts/mxfp4_matmul_bench.py as a user runs it (a GPU times the compiled kernel; here it is interpreted)."""
    path = tmp_path / "bench.json"
    command = [sys.executable, str(Path(__file__).parent.parent / "scripts" / "mxfp4_matmul_bench.py"), "--experts",
               "2", "--rows", "5", "--shapes", "64x80", "--rounds", "2", "--warmup", "1", "--interpret", "--json",
               str(path)]
    result = subprocess.run(command, capture_output=True, text=True, env=command_environment(), timeout=120,
                            check=False)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    (row,) = json.loads(path.read_text())["rows"]
    assert row["shape"] == "64x80" and row["kernel"]["repeats"] == row["xla"]["repeats"] == 2
    assert math.isclose(row["ratio"], row["kernel"]["median_s"] / row["xla"]["median_s"])


# The capacity method with the GPU's kernel, interpreted: 8 experts of L = 64, m/p = 32; "spread" routes 40 tokens
# over all experts, "same-experts" 40 tokens to experts 3 and 5 (overflow rounds, their blocks picked by index).
# The same T: one program (traced and compiled once, which is the cost here) serves both routings.
EXPERTS, LATENT, WIDTH = 8, 64, 32
ROUTINGS = {"spread": 40, "same-experts": 40}


def capacity_inputs(routing_name, poisoned_expert=None):
    rng = np.random.default_rng(3)
    num_tokens = ROUTINGS[routing_name]
    if routing_name == "spread":
        chosen = np.argsort(rng.random((num_tokens, EXPERTS)), axis=1)[:, :2]
    else:
        chosen = np.tile([3, 5], (num_tokens, 1))
    combine = rng.random((num_tokens, 2)).astype(np.float32)
    latent = jnp.asarray(rng.standard_normal((num_tokens, LATENT)), jnp.bfloat16)
    shapes = ((EXPERTS, LATENT, WIDTH),) * 2 + ((EXPERTS, WIDTH, LATENT),)
    kernels = [kimi_k3_mxfp4.random_codes(rng, shape, shape[1] ** -0.5) for shape in shapes]
    if poisoned_expert is not None:
        kernels[0][1][poisoned_expert, 0, 1] = 255  # a NaN scale in its gate kernel
    return latent, jnp.asarray(chosen, jnp.int32), jnp.asarray(combine), [
        kimi_k3_mxfp4.Mxfp4Kernel(jnp.asarray(packed), jnp.asarray(scale)) for packed, scale in kernels]


@functools.cache
def capacity_method(interpret):
    """The capacity method, jitted, its MXFP4 GEMMs the GPU's kernel interpreted (``interpret``) or XLA's: the
    kernel's matmul is patched in while it traces."""

    def method(*arguments):
        with pytest.MonkeyPatch.context() as patch:
            if interpret:
                patch.setattr(kimi_k3_mxfp4.Mxfp4Kernel, "matmul",
                              functools.partialmethod(kimi_k3_mxfp4.Mxfp4Kernel.matmul, interpret=True))
            return routed_experts.experts_by_capacity(*arguments)

    return jax.jit(method)


def capacity(latent, chosen, combine, kernels, *, interpret):
    return np.asarray(capacity_method(interpret)(latent, chosen, combine, *kernels), np.float64)


@pytest.mark.parametrize("routing_name", ROUTINGS)
def test_the_capacity_method_with_the_kernel_computes_what_it_computes_with_xlas_gemms(routing_name):
    # The products are the same; the kernel's float32 sums run in another order, which moves a SiTU output across a
    # bf16 rounding now and then: relative error well under bf16's 2^-8, where a wrong expert's block would be O(1).
    inputs = capacity_inputs(routing_name)
    with_kernel, with_xla = capacity(*inputs, interpret=True), capacity(*inputs, interpret=False)
    assert np.linalg.norm(with_kernel - with_xla) <= 1e-3 * np.linalg.norm(with_xla)


@pytest.mark.parametrize("routing_name", ROUTINGS)
def test_with_the_kernel_a_nan_scale_reaches_exactly_the_tokens_of_its_expert(routing_name):
    for expert in (3, 7):  # one some tokens chose in both routings, one chosen only in the spread routing
        latent, chosen, combine, kernels = capacity_inputs(routing_name, poisoned_expert=expert)
        routed = capacity(latent, chosen, combine, kernels, interpret=True)
        np.testing.assert_array_equal(~np.isfinite(routed).all(axis=1), np.asarray((chosen == expert).any(axis=1)))
