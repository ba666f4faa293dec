"""The norm helper: RMSNorm against numpy, and the all-reduce + norm under shard_map."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
import k3_tail.ops.norm
from helpers import make_tp_mesh
from k3_tail.ops.norm import rms_norm
from k3_tail.tiers.context import TailCall
from reference import TOLERANCE, make_inputs, reference_latent, relative_error


@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_rms_norm_matches_numpy(eps, scale):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 64)).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    scaled = scale * x.astype(np.float64)
    expected = scaled / np.sqrt(np.mean(scaled**2, axis=-1, keepdims=True) + eps) * weight
    actual = rms_norm(jnp.asarray(x), jnp.asarray(weight), eps=eps, scale=scale)
    assert actual.dtype == jnp.float32
    assert relative_error(actual, expected) <= 1e-6


SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


# The (eps, scale) pairs among these that TailConfig accepts at L = 64 (all but eps 1e30 with scale 1e-30 and
# the smallest eps with scale 1e20, whose sqrt(eps) / scale float32 cannot hold).
NORM_SETTINGS = [(eps, scale) for eps in (SMALLEST_NORMAL, 1e-5, 0.1, 1e30) for scale in (1.0, -3.0, 1e20, 1e-30)
                 if k3_tail.ops.norm.norm_is_computable(eps, scale, 64)]


@pytest.mark.parametrize(("eps", "scale"), NORM_SETTINGS)
def test_rms_norm_of_any_finite_row_is_accurate(eps, scale):
    """Rows from float32's smallest normal magnitudes to bfloat16's largest: no overflow or underflow of
    the mean of squares, whatever the scale (float64 reference). Normalised values below about
    2^-114 sqrt(L) flush to zero (the row is divided by a floor of about 2^12 sqrt(L eps) first)."""
    rng = np.random.default_rng(2)
    magnitudes = np.array([2.4e-38, 1e-30, 1e-19, 1e-10, 1e-3, 1.0, 1e10, 1e17, 1e19, 1e30, 3e38])
    # Values of 0.5 to 1 times the magnitude: none subnormal, which float32 would flush on input.
    values = rng.uniform(0.5, 1.0, (magnitudes.size, 64)) * rng.choice([-1.0, 1.0], (magnitudes.size, 64))
    x = values * magnitudes[:, None]
    x = x.astype(np.float32)
    scaled = scale * x.astype(np.float64)
    expected = scaled / np.sqrt(np.mean(scaled**2, axis=-1, keepdims=True) + eps)
    actual = np.asarray(jax.jit(lambda v: rms_norm(v, jnp.ones(64), eps=eps, scale=scale))(x), np.float64)
    row_error = np.linalg.norm(actual - expected, axis=1) / np.maximum(np.linalg.norm(expected, axis=1), 1e-300)
    assert np.all(np.isfinite(actual))
    # A row whose normalised values fall below float32's normal range (x / sqrt(eps) < 1.2e-38) is flushed.
    representable = np.abs(expected).max(axis=1) >= 1e-30
    assert np.all(row_error[representable] <= 1e-6), row_error


@pytest.mark.parametrize(("eps", "scale"), NORM_SETTINGS)
def test_one_shots_row_factor_of_any_finite_row_is_accurate(eps, scale):
    """inverse_rms: scale / sqrt(mean((scale x)^2) + eps) in one pass, for rows from 2.4e-38 to 3e38 (float64
    reference), wherever the factor itself is a normal float32 (RMS times |scale| up to 2^126)."""
    rng = np.random.default_rng(3)
    magnitudes = np.array([0.0, 2.4e-38, 1e-30, 1e-19, 1e-3, 1.0, 1e17, 1e19, 1e30, 3e38])
    values = rng.uniform(0.5, 1.0, (magnitudes.size, 64)) * rng.choice([-1.0, 1.0], (magnitudes.size, 64))
    x = (values * magnitudes[:, None]).astype(np.float32)
    scaled = scale * x.astype(np.float64)
    expected = scale / np.sqrt(np.mean(scaled**2, axis=-1, keepdims=True) + eps)
    actual = np.asarray(jax.jit(lambda v: k3_tail.ops.norm.inverse_rms(v, eps=eps, scale=scale))(x), np.float64)
    normal = np.abs(expected) >= SMALLEST_NORMAL
    np.testing.assert_allclose(actual[normal], expected[normal], rtol=1e-6)


def test_the_norm_settings_leave_out_only_the_two_refused_pairs():
    assert len(NORM_SETTINGS) == 14


@pytest.mark.parametrize(("eps", "scale", "ratio"), [(1e30, 1e-30, r"1e\+90"), (SMALLEST_NORMAL, 1e20, r"1.18e-78")])
def test_the_config_refuses_an_eps_and_scale_the_float32_norm_cannot_resolve(eps, scale, ratio):
    with pytest.raises(ValueError, match=rf"^routed_scaling_factor: with rms_norm_eps=.*got {ratio}$"):
        k3_tail.TailConfig(hidden_size=8, latent_size=64, rms_norm_eps=eps, routed_scaling_factor=scale)


def test_a_zero_row_normalises_to_zeros_with_the_smallest_eps():
    x = jnp.zeros((2, 64), jnp.float32)
    np.testing.assert_array_equal(rms_norm(x, jnp.ones(64), eps=SMALLEST_NORMAL), np.zeros((2, 64)))


def test_rms_norm_propagates_nan_and_infinity_as_the_plain_formula():
    """A NaN makes its row NaN; an infinity NaN at its element and zeros beside it (x / inf)."""
    x = np.ones((3, 64), np.float32)
    x[0, 3], x[1, 5] = np.nan, np.inf
    actual = np.asarray(jax.jit(lambda v: rms_norm(v, jnp.ones(64), eps=1e-5))(x))
    assert np.isnan(actual[0]).all() and np.isfinite(actual[2]).all()
    assert np.isnan(actual[1, 5]) and np.all(np.delete(actual[1], 5) == 0)


def test_rms_norm_without_weight_only_scales():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(rms_norm(x, None, eps=1e-6, scale=2.0), 2 * np.asarray(x))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("use_latent_norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("tp_size", [1, 2, 8])
def test_allreduce_norm_sees_the_fully_reduced_latent(tp_size, use_latent_norm, dtype):
    config = k3_tail.TailConfig(96, 64, use_latent_norm=use_latent_norm, routed_scaling_factor=2.0, dtype=dtype)
    inputs = make_inputs(config, tp_size, 16)
    mesh = make_tp_mesh(tp_size)
    helper = jax.jit(jax.shard_map(
        lambda r, g: TailCall.inside_shard_map(config, axis_name="tp", weight_layout="replicated",
                                               platform=None).normalised_latent(r[0], g),
        mesh=mesh, in_specs=(P("tp"), P()), out_specs=P(),
    ))
    latent = helper(
        jax.device_put(inputs.routed, NamedSharding(mesh, P("tp"))),
        jax.device_put(inputs.norm_weight, NamedSharding(mesh, P())),
    )
    assert latent.dtype == dtype
    assert relative_error(latent, reference_latent(config, inputs.routed, inputs.norm_weight)) <= TOLERANCE[
        np.dtype(dtype)
    ]
