"""The one_kernel tier's Pallas kernel (k3_tail.ops.fused_projection) and where selection uses the tier.

The kernel runs here in Pallas's interpret mode, the same program as on a GPU, its programs in turn. Its
float32 reference is plain jnp; the tier against the float64 reference is in the suite's covering designs
(tests/test_tiers.py and the others that run every tier); the GPU programs are in tests/test_kernels.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3_tail
from k3_tail.ops import float_bits, fused_launch, fused_projection
from k3_tail.ops.fused_launch import TARGET_PROGRAMS, fused_grid
from k3_tail.ops.fused_projection import (
    BlockProjection,
    norm_project_add,
    norm_project_add_into,
    norm_project_add_into_reference,
    norm_project_add_reference,
)
from k3_tail.selection import cost_model
from k3_tail.tiers import one_kernel
from reference import relative_error

L, H, P = 200, 100, 4  # L not a multiple of the 64-deep K step, H not of p: the edges are masked
HB = -(-H // P)
# A bf16 product rounds its operands to 2^-9; the reference does not: about 3e-3 relative, as every tier's GEMM.
KERNEL_TOLERANCE = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5}


@dataclasses.dataclass(frozen=True)
class Case:
    num_tokens: int
    rank: int
    whole_kernel: bool  # the [L, H] kernel (C read at rank * Hb) or the rank's [L, Hb] block
    addend: str  # "into": the addend with its columns C replaced; "block": the block + addend[:, C]; "none"
    scale: float
    norm: bool
    kernel: str  # "bf16" or an FP8 format
    dtype: type = jnp.bfloat16
    target_programs: int = TARGET_PROGRAMS  # 1: one slab of K, the epilogue in the same program

    @property
    def id(self):
        return (f"T{self.num_tokens}-r{self.rank}-{'whole' if self.whole_kernel else 'block'}-{self.addend}-"
                f"c{self.scale:g}-{'norm' if self.norm else 'nonorm'}-{self.kernel}-{jnp.dtype(self.dtype).name}"
                f"-{'split' if self.target_programs > 1 else 'one_slab'}")


# Pairwise over the modes, with a split and an unsplit K, one row and several row tiles (T = 70: two of 64).
CASES = [
    Case(1, 0, False, "into", 1.0, True, "bf16"),
    Case(5, 3, True, "block", 2.0, True, "float8_e4m3fn"),
    Case(16, 1, False, "none", -1.0, True, "float8_e4m3fnuz", target_programs=1),
    Case(70, 2, True, "into", 1.0, False, "bf16", target_programs=1),
    Case(3, 3, False, "into", 0.0, True, "bf16", dtype=jnp.float32),
    Case(33, 1, False, "block", 1.0, False, "float8_e4m3fn", dtype=jnp.float32),
]


def inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    latent = jnp.asarray(rng.standard_normal((case.num_tokens, L)), case.dtype)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(L), case.dtype) if case.norm else None
    padded = rng.standard_normal((L, P * HB)) / np.sqrt(L)
    padded[:, H:] = 0  # the column layout's zero padding
    kernel = padded[:, :H] if case.whole_kernel else padded[:, case.rank * HB:(case.rank + 1) * HB]
    kernel = jnp.asarray(kernel, case.dtype)
    if case.kernel != "bf16":
        kernel = k3_tail.quantize_up_proj(kernel, case.kernel)
    addend = None if case.addend == "none" else jnp.asarray(rng.standard_normal((case.num_tokens, H)), case.dtype)
    return latent, weight, kernel, addend


def arguments(case):
    return dict(projection=BlockProjection(tp_size=P, hidden_size=H, eps=1e-5, scale=case.scale))


@functools.cache
def kernel_call(case, **overrides):
    """The kernel for ``case`` (norm_project_add_into with an "into" addend, else norm_project_add) in interpret
    mode, jitted, taking (latent, weight, kernel, addend, rank): one function per case, so that the tests of a case
    (its ranks among them, an argument) compile it once."""
    options = dict(arguments(case), interpret=True, target_programs=case.target_programs) | overrides
    kernel = norm_project_add_into if case.addend == "into" else norm_project_add
    return jax.jit(lambda latent, weight, kernel_, addend, rank: kernel(
        latent, weight, kernel_, addend, rank=rank, **options))


def reference(case, latent, weight, kernel, addend):
    """The kernel's float32 reference for ``case``."""
    function = norm_project_add_into_reference if case.addend == "into" else norm_project_add_reference
    return function(latent, weight, kernel, addend, rank=jnp.array([case.rank], jnp.int32), **arguments(case))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_the_kernel_computes_its_float32_reference(case):
    """Norm, own columns of the product, the add, one rounding: within the dtype's product rounding; the
    columns of the addend outside C are its own, bit for bit."""
    latent, weight, kernel, addend = inputs(case)
    got = kernel_call(case)(latent, weight, kernel, addend, jnp.array([case.rank], jnp.int32))
    want = reference(case, latent, weight, kernel, addend)
    assert got.shape == want.shape and got.dtype == case.dtype
    own = slice(case.rank * HB, min((case.rank + 1) * HB, H))
    if case.addend == "into":
        outside = np.ones(H, bool)
        outside[own] = False
        np.testing.assert_array_equal(np.asarray(got)[:, outside], np.asarray(addend)[:, outside])
        got, want = got[:, own], want[:, own]
    assert relative_error(got, np.asarray(want, np.float64)) <= KERNEL_TOLERANCE[case.dtype]


def test_a_zero_latent_row_projects_to_the_addend():
    """RMSNorm of a zero row is zero (eps keeps it finite): the row is the addend's."""
    case = CASES[0]
    latent, weight, kernel, addend = inputs(case)
    got = kernel_call(case)(jnp.zeros_like(latent), weight, kernel, addend, jnp.array([0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(addend))


@pytest.mark.parametrize("case", [CASES[0], CASES[1], Case(2, 2, True, "into", 1.0, False, "bf16"),
                                  Case(5, 0, False, "block", -1.0, True, "float8_e4m3fnuz", dtype=jnp.float32)],
                         ids=lambda case: case.id)
def test_the_serial_split_is_the_split_kernel_bit_for_bit(case):
    """The same S slabs summed in one program, in the same order: the oracle of the split's ordering."""
    case = dataclasses.replace(case, target_programs=TARGET_PROGRAMS)
    latent, weight, kernel, addend = inputs(case, seed=1)
    rank = jnp.array([case.rank], jnp.int32)
    assert fused_grid(case.num_tokens, L, HB).splits > 1
    split = kernel_call(case)(latent, weight, kernel, addend, rank)
    serial = kernel_call(case, serial_split=True)(latent, weight, kernel, addend, rank)
    np.testing.assert_array_equal(np.asarray(split).view(np.uint16 if case.dtype == jnp.bfloat16 else np.uint32),
                                  np.asarray(serial).view(np.uint16 if case.dtype == jnp.bfloat16 else np.uint32))


@pytest.mark.parametrize("rank", [-1, P, 2**31 - 1])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=lambda case: case.id)
def test_a_rank_outside_the_axis_gives_nan_never_a_plausible_result(case, rank):
    """Both bounds masked (no access outside the arrays: on a GPU a negative rank would read and write before
    them): the first block's columns are NaN, the rest of the addend is its own."""
    latent, weight, kernel, addend = inputs(case)
    got = np.asarray(kernel_call(case)(latent, weight, kernel, addend, jnp.array([rank], jnp.int32)), np.float32)
    assert np.isnan(got[:, :HB]).all()
    if case.addend == "into":
        np.testing.assert_array_equal(got[:, HB:], np.asarray(addend, np.float32)[:, HB:])


@pytest.mark.parametrize("target_programs", [1, TARGET_PROGRAMS])
@pytest.mark.parametrize("fp8_format", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_fp8_weights_without_the_norm_take_huge_latents_to_finite_results(fp8_format, target_programs):
    """Latent 1e36 times FP8 codes up to 448 passes float32's range before the per-column scale: each slab is
    scaled down by a power of two first, so y is finite where float64 is (and within the product's rounding)."""
    case = Case(4, 1, False, "none", 1.0, False, fp8_format, dtype=jnp.float32, target_programs=target_programs)
    latent, weight, kernel, addend = inputs(case)
    latent = latent * 1e36
    got = kernel_call(case)(latent, weight, kernel, addend, jnp.array([case.rank], jnp.int32))
    want = np.asarray(latent, np.float64) @ np.asarray(kernel.dequantize(), np.float64)
    assert np.isfinite(np.asarray(got)).all()
    assert relative_error(got, want) <= KERNEL_TOLERANCE[jnp.float32]


@pytest.mark.parametrize(("value", "exponent"), [
    (0.0, -20), (2.0**-30, -20), (1.0, 0), (1.5, 1), (2.0, 1), (3.0e38, 126), (np.inf, 126), (np.nan, 126),
])
def test_a_slab_scale_is_the_power_of_two_at_or_above_its_largest_magnitude(value, exponent):
    """Clipped to [floor, 126], so that dividing by it stays exact and in range; NaN and infinity give 126."""
    got = float_bits.exponent_at_or_above(jnp.float32(value), -20)
    assert int(got) == exponent
    assert float(float_bits.power_of_two(got)) == 2.0**exponent


@pytest.mark.parametrize("tp_size", [2, 4, 8, 16])
def test_the_grid_fills_the_device_at_every_token_count_the_tier_serves(tp_size):
    """Kimi-K3, 1 <= T <= one_kernel_max_tokens: at least TARGET_PROGRAMS (1024, what AMD asks of MI300X's 304
    CUs) programs."""
    config = k3_tail.TailConfig.kimi_k3()
    for num_tokens in range(1, config.one_kernel_max_tokens + 1):
        assert fused_grid(num_tokens, 3584, 7168 // tp_size).programs >= TARGET_PROGRAMS, num_tokens


@pytest.mark.parametrize("tp_size", [4, 8, 16])
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_the_scratch_stays_a_fraction_of_the_weight_block(num_tokens, tp_size):
    """Partials at most half the bf16 block's bytes; with exponents and counters at most 0.55 (T = 1, p = 8:
    0.017)."""
    block_width = 7168 // tp_size
    assert fused_grid(num_tokens, 3584, block_width).scratch_bytes(num_tokens) <= 0.55 * 2 * 3584 * block_width


def test_the_counters_start_at_values_xla_cannot_fold_into_a_broadcast():
    """Not all equal and not an iota (XLA writes those with a kernel), and the kernel's formula agrees."""
    for tiles in (1, 28):
        starts = fused_projection._counter_starts(tiles)
        assert len(set(starts.tolist())) > 2 and not np.all(np.diff(starts) == np.diff(starts)[0])
    words = jnp.arange(starts.size, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(fused_projection._counter_start(words)), starts)


def test_each_tiles_counter_has_a_128_byte_line_of_its_own():
    """No two tiles' atomics contend for one cache line (128 bytes on every GPU here)."""
    assert fused_launch.COUNTER_STRIDE * 4 == 128
    assert fused_projection._counter_starts(28).size == 28 * fused_launch.COUNTER_STRIDE


@pytest.mark.parametrize(("platform", "warps"), [("cuda", 4), ("rocm", 1), ("gpu", 1), (None, 1)])
def test_a_program_is_one_wavefront_except_on_nvidia(platform, warps):
    """AMD orders a release or acquire for its own wavefront only; a GPU of unknown vendor is taken as AMD's."""
    assert fused_launch.warps_per_program(platform) == warps


# --- Where selection uses it --------------------------------------------------------------------------------

K3 = k3_tail.TailConfig.kimi_k3()


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_vllm_rules_pick_one_kernel_on_gpus_up_to_its_token_limit(platform):
    for num_tokens in (1, 16, K3.one_kernel_max_tokens):
        decision = k3_tail.select_tier(K3, num_tokens, 8, weight_layout="column", platform=platform)
        assert decision.tier is k3_tail.Tier.ONE_KERNEL
        assert "one GPU kernel" in decision.rule and platform in decision.rule
    later = k3_tail.select_tier(K3, K3.one_kernel_max_tokens + 1, 8, weight_layout="column", platform=platform)
    assert later.tier is k3_tail.Tier.OVERLAP and "one_kernel" not in later.reason


@pytest.mark.parametrize("platform", ["cpu", None])
def test_vllm_rules_never_pick_one_kernel_off_a_gpu(platform):
    """On a CPU its kernel runs interpreted; an unknown platform may be one."""
    assert k3_tail.select_tier(K3, 1, 8, weight_layout="column", platform=platform).tier is k3_tail.Tier.OVERLAP


def test_one_kernel_max_tokens_zero_turns_it_off():
    config = dataclasses.replace(K3, one_kernel_max_tokens=0)
    assert k3_tail.select_tier(config, 1, 8, weight_layout="column", platform="rocm").tier is k3_tail.Tier.OVERLAP


def test_without_pallas_triton_the_tier_is_unavailable_and_selection_says_why(monkeypatch):
    """A jax without the backend (deprecated since jax 0.11): the record refuses, selection takes the next tier."""
    monkeypatch.setattr(one_kernel, "triton_unavailable", lambda: "this jax has no Pallas Triton backend")
    assert "no Pallas Triton backend" in k3_tail.Tier.ONE_KERNEL.why_not("column", K3)
    decision = k3_tail.select_tier(K3, 1, 8, weight_layout="column", platform="cuda")
    assert decision.tier is k3_tail.Tier.OVERLAP
    assert "not one_kernel" in decision.rule and "no Pallas Triton backend" in decision.rule


def test_fp8_activations_are_served_by_the_other_tiers():
    config = k3_tail.TailConfig.kimi_k3(up_proj_dtype="float8_e4m3fn", fp8_activations=True)
    assert "fp8_activations" in k3_tail.Tier.ONE_KERNEL.why_not("column", config)
    decision = k3_tail.select_tier(config, 1, 8, weight_layout="column", platform="cuda")
    assert decision.tier is k3_tail.Tier.OVERLAP and "fp8_activations" in decision.rule


@pytest.mark.parametrize("fp8_format", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_fp8_bytes_decode_to_their_values_exactly(fp8_format):
    """All 256 codes, against ml_dtypes' view of the same bytes (NaN where it has NaN, signed zeros)."""
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(jnp.dtype(fp8_format)).astype(np.float32)
    got = np.asarray(float_bits.decode_fp8(jnp.asarray(codes), fp8_format))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite], want[finite])
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


@pytest.mark.parametrize(("platform", "tier"), [("rocm", k3_tail.Tier.ONE_KERNEL), ("cuda", k3_tail.Tier.ONE_KERNEL),
                                                ("cpu", k3_tail.Tier.COLUMN_PARALLEL),
                                                (None, k3_tail.Tier.COLUMN_PARALLEL)])
def test_the_cost_model_policy_picks_one_kernel_only_where_it_runs_compiled(platform, tier):
    config = dataclasses.replace(K3, selection_policy=cost_model.CostModelPolicy("mi355x"))
    decision = k3_tail.select_tier(config, 1, 8, weight_layout="column", platform=platform)
    assert decision.tier is tier
    assert ("one_kernel" in decision.rule) == (tier is k3_tail.Tier.ONE_KERNEL)
