"""The norm helper: RMSNorm against numpy, and the all-reduce + norm under shard_map."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from helpers import make_tp_mesh
from reference import TOLERANCE, make_inputs, reference_latent, relative_error


@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_rms_norm_matches_numpy(eps, scale):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 64)).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    scaled = scale * x.astype(np.float64)
    expected = scaled / np.sqrt(np.mean(scaled**2, axis=-1, keepdims=True) + eps) * weight
    actual = k3_tail.rms_norm(jnp.asarray(x), jnp.asarray(weight), eps=eps, scale=scale)
    assert actual.dtype == jnp.float32
    assert relative_error(actual, expected) <= 1e-6


def test_rms_norm_without_weight_only_scales():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(k3_tail.rms_norm(x, None, eps=1e-6, scale=2.0), 2 * np.asarray(x))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("use_latent_norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("tp_size", [1, 2, 8])
def test_allreduce_norm_sees_the_fully_reduced_latent(tp_size, use_latent_norm, dtype):
    config = k3_tail.TailConfig(96, 64, use_latent_norm=use_latent_norm, routed_scaling_factor=2.0, dtype=dtype)
    inputs = make_inputs(config, tp_size, 16)
    mesh = make_tp_mesh(tp_size)
    helper = jax.jit(jax.shard_map(
        lambda r, g: k3_tail.allreduce_norm_latent_out(r[0], g, config=config, axis_name="tp"),
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
