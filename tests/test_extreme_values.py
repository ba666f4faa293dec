"""Extreme values through every tier: NaN and infinity in the partials, and latents whose squares overflow float32.

**Non-finite values**, through every sum, quantised or not, at Kimi-K3's widths (L = 3584, H = 7168). The
float64 reference sums the partials as the bf16 sums do: a NaN anywhere in a row's routed partials makes
the whole row NaN (the norm's mean sees it), an infinity there too (the norm divides it by an infinite RMS);
a NaN or an infinity in a shared partial reaches y at its own element only. A tier must be non-finite
exactly where the reference is (an infinity may arrive as NaN: a quantised sum codes every non-finite
value as NaN) and within its tolerance everywhere else. T = 4 rows on 8 ranks, one case per row:

    row 0: NaN in rank 3's routed partial      row 2: NaN in rank 5's shared partial
    row 1: +inf in rank 6's routed partial     row 3: -inf in rank 0's shared partial

Every sum is quantised from 0 bytes on, so each buffer's blocks span [8, >= 28, 32]: large enough for
XLA:CPU's max reduction to drop a NaN, which a codec must not rely on.

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
KIMI_K3 = k3_tail.TailConfig.kimi_k3()
NON_FINITE = {  # (term, rank, row, column): value
    ("routed", 3, 0, 100): np.nan,
    ("routed", 6, 1, 2000): np.inf,
    ("shared", 5, 2, 5): np.nan,
    ("shared", 0, 3, 7000): -np.inf,
}


def quantised(codec):
    """Kimi-K3's tail with every sum in ``codec`` (None: bf16 sums)."""
    if codec is None:
        return KIMI_K3
    return dataclasses.replace(KIMI_K3, all_reduce_quantization=codec, quantized_all_reduce_min_bytes=0)


@pytest.fixture(scope="module")
def inputs():
    """(finite inputs, the same with NON_FINITE written in)."""
    clean = make_inputs(KIMI_K3, TP_SIZE, NUM_TOKENS)
    routed, shared = clean.routed.copy(), clean.shared.copy()
    for (term, rank, row, column), value in NON_FINITE.items():
        (routed if term == "routed" else shared)[rank, row, column] = value
    return clean, dataclasses.replace(clean, routed=routed, shared=shared)


@pytest.fixture(scope="module")
def poisoned_reference(inputs):
    """The float64 reference of the poisoned inputs (the same for every codec: the reference sums exactly), and
    codec -> the tolerance its predicted rounding of the clean inputs allows. Computed once: at Kimi-K3's widths each
    takes the float64 [L, H] kernel (205 MB)."""
    clean, poisoned = inputs
    with np.errstate(invalid="ignore"):  # the reference's own NaN rows
        expected = reference_tail(KIMI_K3, poisoned)
    return expected, {codec: tolerance(quantised(codec), clean) for codec in CODECS}


def assert_non_finite_where_the_reference_is(y, expected):
    """NaN where the reference is NaN, the same infinity or NaN where it is infinite, finite elsewhere."""
    y = np.asarray(y, np.float64)
    assert np.array_equal(np.isnan(expected), np.isnan(y) & np.isnan(expected))
    infinite = np.isinf(expected)
    assert np.all(np.isnan(y[infinite]) | (y[infinite] == expected[infinite]))
    assert np.array_equal(np.isfinite(y), np.isfinite(expected))


# one_kernel's Pallas kernel runs interpreted here (seconds a call at these widths): its own NaN and infinity
# handling is in its kernel, ahead of the sums, and its sums are column_parallel's, which meets every codec.
NON_FINITE_CASES = [pytest.param(tier, codec, id=f"{tier.value}-{codec or 'bf16'}") for tier in k3_tail.Tier
                    for codec in CODECS if tier is not k3_tail.Tier.ONE_KERNEL or codec is None]


@pytest.mark.parametrize(("tier", "codec"), NON_FINITE_CASES)
def test_a_non_finite_partial_is_non_finite_in_y_exactly_where_the_reference_is(inputs, poisoned_reference, tier,
                                                                               codec):
    _, poisoned = inputs
    config = quantised(codec)
    expected, tolerances = poisoned_reference
    assert np.isnan(expected[0]).all() and np.isnan(expected[1]).all()  # the cases above, as the reference has them
    assert np.isnan(expected[2, 5]) and expected[3, 7000] == -np.inf and np.isfinite(expected[2:]).sum() == 2 * 7168 - 2
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
    assert np.isfinite(expected).sum() == NUM_TOKENS * 7168 - 2


SMALL = k3_tail.TailConfig(hidden_size=96, latent_size=64)


@pytest.mark.parametrize(("magnitude", "scale"), [(1e18, 1.0), (1e37, 1.0), (1.0, 1e20), (1e20, -1e20), (1e-30, 1.0)],
                         ids=["1e18", "1e37", "scale-1e20", "1e20-scale--1e20", "1e-30"])
@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda tier: tier.value)
def test_a_latent_whose_squares_overflow_float32_is_still_normalised(tier, magnitude, scale):
    """Rows of about ``magnitude`` (bf16 holds them; their squares' mean overflows float32 from about 3e17 at
    L = 3584, or once the scale multiplies them) keep the routed term: y matches the reference."""
    config = dataclasses.replace(SMALL, routed_scaling_factor=scale)
    inputs = make_inputs(config, 4, 5)
    routed = np.asarray(jnp.asarray(inputs.routed.astype(np.float64) * magnitude, config.dtype))
    inputs = dataclasses.replace(inputs, routed=routed)
    y = k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=config,
                             mesh=make_tp_mesh(4), tier=tier)
    assert relative_error(y, reference_tail(config, inputs)) <= tolerance(config, inputs)


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


@pytest.mark.parametrize(("value", "finite"), [(1.6e38, True), (2.5e38, False)], ids=["sum-in-range", "sum-overflows"])
@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda tier: tier.value)
def test_finite_partials_give_a_finite_y_while_their_sum_is_in_the_dtypes_range(tier, value, finite):
    """The contract's limit (docs/design.md, "Extreme values"): the latent's sum over the ranks is formed in the
    activation dtype, so two ranks' 1.6e38 in one element (sum 3.2e38, below bf16's 3.39e38) stay finite and exact,
    while two 2.5e38s overflow the sum to infinity and that token's row of y is NaN on every tier: never a finite
    result."""
    inputs = make_inputs(SMALL, 4, 3)
    routed = inputs.routed.copy()
    routed[1:3, 1, 7] = value
    inputs = dataclasses.replace(inputs, routed=routed)
    y = np.asarray(k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=SMALL,
                                        mesh=make_tp_mesh(4), tier=tier), np.float64)
    if finite:
        assert np.isfinite(y).all()
        assert relative_error(y, reference_tail(SMALL, inputs)) <= tolerance(SMALL, inputs)
    else:
        assert np.isnan(y[1]).all() and np.isfinite(np.delete(y, 1, axis=0)).all()
