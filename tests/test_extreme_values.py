"""Extreme values through every tier: NaN and infinity in the partials, and latents whose squares overflow float32.

**Non-finite values**, through every sum, quantised or not, at half Kimi-K3's widths (L = 1792, H = 3584). The
float64 reference sums the partials as the bf16 sums do: a NaN anywhere in a row's routed partials makes
the whole row NaN (the norm's mean sees it), an infinity there too (the norm divides it by an infinite RMS);
a NaN or an infinity in a shared partial reaches y at its own element only. A tier must be non-finite
exactly where the reference is (an infinity may arrive as NaN: a quantised sum codes every non-finite
value as NaN) and within its tolerance everywhere else. T = 4 rows on 8 ranks, one case per row:

    row 0: NaN in rank 3's routed partial      row 2: NaN in rank 5's shared partial
    row 1: +inf in rank 6's routed partial     row 3: -inf in rank 0's shared partial

Every sum is quantised from 0 bytes on, so each buffer's first-shot blocks span [8, >= 28, 32]: large enough for
XLA:CPU's max reduction to drop a NaN (it does from 8 x 16 blocks on, measured), which a codec must not rely on.
Nothing else here depends on the widths: half Kimi-K3's keep that margin at a quarter of the kernel.

**Large finite latents**: the mean of squares of a row of 1e18s overflows float32 (and the routed term
would vanish); every tier, one_shot's row scale included, must still match the reference.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from helpers import make_tp_mesh
from reference import make_inputs, reference_tail, relative_error, tolerance

CODECS = (None, "int8", "int6", "int4")
TP_SIZE, NUM_TOKENS = 8, 4
WIDE = dataclasses.replace(k3_tail.TailConfig.kimi_k3(), latent_size=1792, hidden_size=3584)
NON_FINITE = {  # (term, rank, row, column): value
    ("routed", 3, 0, 100): np.nan,
    ("routed", 6, 1, 1000): np.inf,
    ("shared", 5, 2, 5): np.nan,
    ("shared", 0, 3, 3500): -np.inf,
}


def quantised(codec):
    """The wide tail with every sum in ``codec`` (None: bf16 sums)."""
    if codec is None:
        return WIDE
    return dataclasses.replace(WIDE, all_reduce_quantization=codec, quantized_all_reduce_min_bytes=0)


@pytest.fixture(scope="module")
def inputs():
    """(finite inputs, the same with NON_FINITE written in)."""
    clean = make_inputs(WIDE, TP_SIZE, NUM_TOKENS)
    routed, shared = clean.routed.copy(), clean.shared.copy()
    for (term, rank, row, column), value in NON_FINITE.items():
        (routed if term == "routed" else shared)[rank, row, column] = value
    return clean, dataclasses.replace(clean, routed=routed, shared=shared)


@pytest.fixture(scope="module")
def poisoned_reference(inputs):
    """The float64 reference of the poisoned inputs (the same for every codec: the reference sums exactly), and
    codec -> the tolerance its predicted rounding of the clean inputs allows. Computed once: each takes the
    float64 [L, H] kernel (51 MB)."""
    clean, poisoned = inputs
    with np.errstate(invalid="ignore"):  # the reference's own NaN rows
        expected = reference_tail(WIDE, poisoned)
    return expected, {codec: tolerance(quantised(codec), clean) for codec in CODECS}


def assert_non_finite_where_the_reference_is(y, expected):
    """NaN where the reference is NaN, the same infinity or NaN where it is infinite, finite elsewhere."""
    y = np.asarray(y, np.float64)
    assert np.array_equal(np.isnan(expected), np.isnan(y) & np.isnan(expected))
    infinite = np.isinf(expected)
    assert np.all(np.isnan(y[infinite]) | (y[infinite] == expected[infinite]))
    assert np.array_equal(np.isfinite(y), np.isfinite(expected))


# Every tier with bf16 sums (its own handling) and with at least one codec; every codec through both sum forms, the
# all-reduce (native, overlap, column_parallel, one_shot) and the reduce-scatter (scatter_gather, token_parallel).
# A codec marks a non-finite value inside its block, the same function under every tier: what a tier adds is where
# its buffers' blocks fall, which this design meets once per tier. ``pytest -m slow`` runs the rest of the product.
# one_kernel's Pallas kernel runs interpreted here (seconds a call at these widths): its own NaN and infinity
# handling is in its kernel, ahead of the sums, and its sums are column_parallel's.
CODECS_RUN_BY_DEFAULT = {"native": ("int8",), "overlap": ("int6",), "column_parallel": ("int4",), "one_shot": ("int8",),
                        "scatter_gather": ("int6",), "token_parallel": ("int8", "int4")}
NON_FINITE_CASES = [
    pytest.param(tier, codec, id=f"{tier.value}-{codec or 'bf16'}",
                 marks=() if codec in (None, *CODECS_RUN_BY_DEFAULT.get(tier.value, ())) else pytest.mark.slow)
    for tier in k3_tail.Tier for codec in CODECS if tier is not k3_tail.Tier.ONE_KERNEL or codec is None
]


@pytest.mark.parametrize(("tier", "codec"), NON_FINITE_CASES)
def test_a_non_finite_partial_is_non_finite_in_y_exactly_where_the_reference_is(inputs, poisoned_reference, tier,
                                                                               codec):
    _, poisoned = inputs
    config = quantised(codec)
    expected, tolerances = poisoned_reference
    assert np.isnan(expected[0]).all() and np.isnan(expected[1]).all()  # the cases above, as the reference has them
    assert np.isnan(expected[2, 5]) and expected[3, 3500] == -np.inf
    assert np.isfinite(expected[2:]).sum() == 2 * WIDE.hidden_size - 2
    y = k3_tail.tail_forward(poisoned.routed, poisoned.shared, poisoned.norm_weight, poisoned.kernel, config=config,
                             mesh=make_tp_mesh(TP_SIZE), tier=tier)
    assert_non_finite_where_the_reference_is(y, expected)
    finite = np.isfinite(expected)
    assert relative_error(np.asarray(y, np.float64)[finite], expected[finite]) <= tolerances[codec]


@pytest.mark.parametrize("codec", CODECS, ids=lambda codec: codec or "bf16")
def test_reduce_shared_keeps_each_non_finite_value_at_its_own_element(inputs, codec):
    _, poisoned = inputs
    config = dataclasses.replace(quantised(codec), shared_output_is_reduced=True)
    mesh = make_tp_mesh(TP_SIZE)
    reduce = jax.jit(jax.shard_map(lambda x: k3_tail.reduce_shared(x[0], config=config), mesh=mesh,
                                   in_specs=P("tp"), out_specs=P()))
    summed = reduce(jax.device_put(jnp.asarray(poisoned.shared), NamedSharding(mesh, P("tp"))))
    expected = np.asarray(poisoned.shared, np.float64).sum(axis=0)
    assert_non_finite_where_the_reference_is(summed, expected)
    assert np.isfinite(expected).sum() == NUM_TOKENS * WIDE.hidden_size - 2


SMALL = k3_tail.TailConfig(hidden_size=96, latent_size=64)
# Rows are independent tokens, so one call holds rows of several magnitudes (row i: the i-th mod their count) under
# one routed scale: bf16 holds every row; their squares' mean overflows float32 from about 3e17 at L = 3584 (1e18,
# 1e37), or once the scale multiplies them (scale -1e20: rows of 1, and rows of 1e20 whose product with it
# overflows float32 itself); rows of 1e-30 have squares below float32's smallest normal.
EXTREME_ROWS = {1.0: (1e18, 1e37, 1e-30), -1e20: (1.0, 1e20)}  # routed scale: the magnitudes of the rows


@pytest.mark.parametrize("scale", list(EXTREME_ROWS), ids=lambda scale: f"scale{scale:g}")
@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda tier: tier.value)
def test_a_latent_whose_squares_overflow_float32_is_still_normalised(tier, scale):
    """The rows of each magnitude keep the routed term: they match the reference."""
    config = dataclasses.replace(SMALL, routed_scaling_factor=scale)
    inputs = make_inputs(config, 4, 6)
    row_magnitudes = np.resize(EXTREME_ROWS[scale], 6)
    routed = np.asarray(jnp.asarray(inputs.routed.astype(np.float64) * row_magnitudes[:, None], config.dtype))
    inputs = dataclasses.replace(inputs, routed=routed)
    y = np.asarray(k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=config,
                                        mesh=make_tp_mesh(4), tier=tier), np.float64)
    expected = reference_tail(config, inputs)
    for magnitude in EXTREME_ROWS[scale]:
        rows = row_magnitudes == magnitude
        assert relative_error(y[rows], expected[rows]) <= tolerance(config), f"the rows of {magnitude:g}"


@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda tier: tier.value)
def test_a_zero_latent_row_with_the_smallest_eps_normalises_to_zeros(tier):
    """A padding token's row is all zeros; eps as small as float32's smallest normal must keep it finite."""
    config = dataclasses.replace(SMALL, rms_norm_eps=float(np.finfo(np.float32).tiny))
    inputs = make_inputs(config, 4, 5)
    routed = inputs.routed.copy()
    routed[:, 2] = 0
    inputs = dataclasses.replace(inputs, routed=routed)
    y = k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=config,
                             mesh=make_tp_mesh(4), tier=tier)
    assert np.all(np.isfinite(np.asarray(y, np.float32)))
    assert relative_error(y, reference_tail(config, inputs)) <= tolerance(config, inputs)


@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda tier: tier.value)
def test_finite_partials_give_a_finite_y_while_their_sum_is_in_the_dtypes_range(tier):
    """The contract's limit (docs/design.md, "Extreme values"): the latent's sum over the ranks is formed in the
    activation dtype, so two ranks' 1.6e38 in one element (sum 3.2e38, below bf16's 3.39e38: token 1) stay finite
    and exact, while two 2.5e38s (token 3) overflow the sum to infinity and that token's row of y is NaN on every
    tier: never a finite result. One call holds both: rows are independent tokens."""
    inputs = make_inputs(SMALL, 4, 5)
    routed = inputs.routed.copy()
    routed[1:3, 1, 7] = 1.6e38
    routed[1:3, 3, 7] = 2.5e38
    inputs = dataclasses.replace(inputs, routed=routed)
    y = np.asarray(k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=SMALL,
                                        mesh=make_tp_mesh(4), tier=tier), np.float64)
    assert np.isnan(y[3]).all()
    in_range = np.delete(y, 3, axis=0)
    assert np.isfinite(in_range).all()
    with np.errstate(invalid="ignore", over="ignore"):  # the reference's own overflowing row
        expected = np.delete(reference_tail(SMALL, inputs), 3, axis=0)
    assert relative_error(in_range, expected) <= tolerance(SMALL)
