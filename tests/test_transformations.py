"""The tail composes like jax's own ops: grad, vjp and jvp on every tier (one_kernel by its custom VJP, whose
backward is plain XLA), vmap over a batch of calls, scan, remat; the quantised sums refuse to be differentiated.

Gradients with respect to the routed and shared partials, the norm weight and the kernel, against native's
(float32, within 1e-5 relative) and against a float32 central difference along a random direction.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from helpers import make_tp_mesh

P_SIZE = 8
CONFIG = k3_tail.TailConfig(hidden_size=100, latent_size=64, dtype=jnp.float32)
NUM_TOKENS = 4
GRADIENT_TOLERANCE = 1e-5  # relative, against native's gradients (float32)
DIFFERENCE_TOLERANCE = 2e-2  # relative, against a float32 central difference


@pytest.fixture(scope="module")
def mesh():
    return make_tp_mesh(P_SIZE, jax.sharding.AxisType.Auto)  # cotangents and directions placed by jit


def tail_of(mesh, config, tier, weight_layout):
    """The tail on global arrays: routed [p*T, L] and shared [p*T, H] stacked by rank, norm weight, kernel."""
    def layer(routed, shared, norm_weight, kernel, rank):
        return k3_tail.latent_moe_tail(routed, shared, norm_weight, kernel, config=config, axis_name="tp",
                                       weight_layout=weight_layout, tier=tier, rank=rank)

    kernel_spec = P(None, "tp") if weight_layout == "column" else P()
    out_spec = P("tp") if config.sequence_parallel else P()
    specs = (P("tp"), P("tp"), P(), kernel_spec, P("tp"))
    ranks = jax.device_put(np.arange(P_SIZE, dtype=np.int32), NamedSharding(mesh, P("tp")))
    program = jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=out_spec)
    return lambda *arrays: program(*arrays, ranks), specs[:4]


def inputs(mesh, specs, weight_layout, seed=0, batch=()):
    rng = np.random.default_rng(seed)
    latent, hidden = CONFIG.latent_size, CONFIG.hidden_size
    width = k3_tail.padded_hidden_size(hidden, P_SIZE) if weight_layout == "column" else hidden
    kernel = np.zeros((latent, width))
    kernel[:, :hidden] = rng.standard_normal((latent, hidden)) / latent**0.5
    arrays = (rng.standard_normal((*batch, P_SIZE * NUM_TOKENS, latent)),
              rng.standard_normal((*batch, P_SIZE * NUM_TOKENS, hidden)),
              1 + 0.1 * rng.standard_normal((*batch, latent)), np.broadcast_to(kernel, (*batch, *kernel.shape)))
    return [jax.device_put(x.astype(np.float32), NamedSharding(mesh, P(*[None] * len(batch), *spec)))
            for x, spec in zip(arrays, specs, strict=True)]


def relative(x, y):
    return float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))


# (tier, weight layout, config changes): every tier, both layouts among them, sequence-parallel output for
# token_parallel (and once more), a reduced shared output.
CASES = [
    ("native", "replicated", {}),
    ("overlap", "column", {}),
    ("column_parallel", "replicated", {"sequence_parallel": True}),
    ("one_shot", "replicated", {}),
    ("scatter_gather", "column", {}),
    ("token_parallel", "replicated", {"sequence_parallel": True}),
    ("one_kernel", "column", {}),
    ("one_kernel", "replicated", {}),
]


def loss_and_gradients(mesh, config, tier, weight_layout):
    """(the jitted loss <tail(arrays), cotangent>, its inputs, its gradients with respect to the four arrays)."""
    tail, specs = tail_of(mesh, config, tier, weight_layout)
    arrays = inputs(mesh, specs, weight_layout)
    cotangent = jax.random.normal(jax.random.key(1), jax.eval_shape(tail, *arrays).shape)
    loss = jax.jit(lambda *a: jnp.vdot(tail(*a), cotangent))
    return loss, arrays, jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*arrays)


@functools.cache
def native_gradients(mesh, weight_layout, changes):
    """native's gradients for a config (``changes`` as sorted items), once for the tiers that compare with them."""
    return loss_and_gradients(mesh, dataclasses.replace(CONFIG, **dict(changes)), "native", weight_layout)[2]


@pytest.mark.parametrize(("tier", "weight_layout", "changes"), CASES, ids=[f"{t}-{w}" for t, w, _ in CASES])
def test_every_tiers_gradient_is_natives_and_the_finite_differences(mesh, tier, weight_layout, changes):
    config = dataclasses.replace(CONFIG, **changes)
    loss, arrays, gradients = loss_and_gradients(mesh, config, tier, weight_layout)
    wanted = native_gradients(mesh, weight_layout, tuple(sorted(changes.items())))
    for gradient, want in zip(gradients, wanted, strict=True):
        assert relative(gradient, want) <= GRADIENT_TOLERANCE

    directions = [jax.random.normal(jax.random.key(2 + i), x.shape) for i, x in enumerate(arrays)]
    step = 1e-2
    moved = [[x + sign * step * d for x, d in zip(arrays, directions, strict=True)] for sign in (1, -1)]
    difference = (loss(*moved[0]) - loss(*moved[1])) / (2 * step)
    predicted = sum(jnp.vdot(g, d) for g, d in zip(gradients, directions, strict=True))
    assert abs(difference - predicted) <= DIFFERENCE_TOLERANCE * abs(predicted)


@pytest.mark.parametrize("tier", ["one_kernel", "column_parallel"])
def test_jvp_agrees_with_vjp(mesh, tier):
    tail, specs = tail_of(mesh, CONFIG, tier, "column")
    arrays = inputs(mesh, specs, "column")
    tangents = [jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(arrays)]
    _, forward = jax.jit(lambda a, t: jax.jvp(tail, a, t))(arrays, tangents)
    cotangent = jax.random.normal(jax.random.key(9), forward.shape)
    pulled = jax.jit(lambda a, c: jax.vjp(tail, *a)[1](c))(arrays, cotangent)
    backward = sum(jnp.vdot(c, t) for c, t in zip(pulled, tangents, strict=True))
    assert abs(jnp.vdot(cotangent, forward) - backward) <= 1e-4 * abs(backward)


@pytest.mark.parametrize("tier", [None, "one_kernel", "overlap"])
def test_vmap_over_a_batch_of_calls_is_each_call(mesh, tier):
    tail, specs = tail_of(mesh, CONFIG, tier, "column")
    batch = inputs(mesh, specs, "column", batch=(2,))
    together = jax.jit(jax.vmap(tail))(*batch)
    for i in range(2):
        assert relative(together[i], jax.jit(tail)(*[x[i] for x in batch])) <= 1e-6


def test_scan_over_stacked_calls_is_each_call(mesh):
    tail, specs = tail_of(mesh, CONFIG, None, "column")
    batch = inputs(mesh, specs, "column", batch=(3,))
    _, stacked = jax.jit(lambda *xs: jax.lax.scan(lambda carry, x: (carry, tail(*x)), 0, xs))(*batch)
    for i in range(3):
        assert relative(stacked[i], jax.jit(tail)(*[x[i] for x in batch])) <= 1e-6


@pytest.mark.parametrize("tier", [None, "one_kernel"])
def test_remat_gives_the_same_gradient(mesh, tier):
    tail, specs = tail_of(mesh, CONFIG, tier, "column")
    arrays = inputs(mesh, specs, "column")

    def loss(function):
        return jax.jit(jax.grad(lambda *a: jnp.sum(function(*a) ** 2), argnums=(0, 3)))

    for gradient, want in zip(loss(jax.checkpoint(tail))(*arrays), loss(tail)(*arrays), strict=True):
        assert relative(gradient, want) <= 1e-6


def test_differentiating_quantised_sums_names_the_switch(mesh):
    config = dataclasses.replace(CONFIG, dtype=jnp.bfloat16, all_reduce_quantization="int8",
                                 quantized_all_reduce_min_bytes=1)
    tail, specs = tail_of(mesh, config, "column_parallel", "column")
    arrays = [x.astype(jnp.bfloat16) for x in inputs(mesh, specs, "column")]
    with pytest.raises(ValueError, match=r"all_reduce_quantization='int8'.*all_reduce_quantization=None"):
        jax.grad(lambda *a: jnp.sum(tail(*a).astype(jnp.float32)))(*arrays)
