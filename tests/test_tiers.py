"""Every tier computes the tail's function: parity with the float64 reference, and the column contract."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from conftest import layout_for, make_tp_mesh, tier_layouts
from reference import TOLERANCE, make_inputs, reference_latent, reference_tail, relative_error

SMALL = k3_tail.TailConfig(hidden_size=96, latent_size=64)  # 96 divides by 1, 2, 4, 8
SMALL_ODD = dataclasses.replace(SMALL, hidden_size=99)  # 99 divides by none of 2, 4, 8
DTYPES = [jnp.bfloat16, jnp.float32]
LAYOUTS = list(k3_tail.WEIGHT_LAYOUTS)


def run_tail(config, inputs, mesh, tier, weight_layout, **overrides):
    arrays = dict(
        routed_partials=inputs.routed,
        shared_partials=inputs.shared,
        norm_weight=inputs.norm_weight if config.use_latent_norm else None,
        up_proj_kernel=inputs.kernel,
    )
    arrays.update(overrides)
    return k3_tail.tail_forward(**arrays, config=config, mesh=mesh, tier=tier, weight_layout=weight_layout)


def assert_matches_reference(config, inputs, y, expected=None):
    expected = reference_tail(config, inputs) if expected is None else expected
    assert y.shape == expected.shape
    assert y.dtype == config.dtype
    if expected.size:
        assert relative_error(y, expected) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("base", [SMALL, SMALL_ODD], ids=["H96", "H99"])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 16, 257, 1024])
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_tier_matches_float64_reference(tier, tp_size, num_tokens, base, dtype, weight_layout):
    config = dataclasses.replace(base, dtype=dtype)
    inputs = make_inputs(config, tp_size, num_tokens)
    y = run_tail(config, inputs, make_tp_mesh(tp_size), tier, weight_layout)
    assert_matches_reference(config, inputs, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("use_latent_norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["scale1", "scale2"])
@pytest.mark.parametrize("base", [SMALL, SMALL_ODD], ids=["H96", "H99"])
@pytest.mark.parametrize("tp_size", [2, 8])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_tier_honours_scale_and_norm(tier, tp_size, base, scale, use_latent_norm, dtype, weight_layout):
    config = dataclasses.replace(
        base, routed_scaling_factor=scale, use_latent_norm=use_latent_norm, dtype=dtype
    )
    inputs = make_inputs(config, tp_size, 16)
    y = run_tail(config, inputs, make_tp_mesh(tp_size), tier, weight_layout)
    assert_matches_reference(config, inputs, y)


@pytest.mark.parametrize("use_latent_norm", [True, False], ids=["norm", "no_norm"])
def test_the_tolerance_detects_a_wrong_tail(use_latent_norm):
    """The inputs make every term matter: dropping one or ignoring the scale misses by far more than 1e-2."""
    config = dataclasses.replace(SMALL, use_latent_norm=use_latent_norm, routed_scaling_factor=2.0)
    inputs = make_inputs(config, 8, 16)
    expected = reference_tail(config, inputs)
    tolerance = TOLERANCE[config.dtype]
    without_shared = dataclasses.replace(inputs, shared=None)
    assert relative_error(reference_tail(config, without_shared), expected) > 10 * tolerance
    without_routed = dataclasses.replace(inputs, routed=np.zeros_like(inputs.routed))
    assert relative_error(reference_tail(config, without_routed), expected) > 10 * tolerance
    one_rank_routed = dataclasses.replace(inputs, routed=inputs.routed[:1])
    assert relative_error(reference_tail(config, one_rank_routed), expected) > 10 * tolerance
    if not use_latent_norm:
        unscaled = dataclasses.replace(config, routed_scaling_factor=1.0)
        assert relative_error(reference_tail(unscaled, inputs), expected) > 10 * tolerance


@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_tier_without_shared_experts(tier, weight_layout):
    config = dataclasses.replace(SMALL_ODD, has_shared_experts=False)
    inputs = dataclasses.replace(make_inputs(config, 4, 5), shared=None)
    y = run_tail(config, inputs, make_tp_mesh(4), tier, weight_layout)
    assert_matches_reference(config, inputs, y)


@pytest.mark.parametrize("tier", [t for t in k3_tail.Tier if t != k3_tail.Tier.ONE_SHOT], ids=lambda t: t.value)
def test_tier_with_an_already_reduced_routed_output(tier):
    """fused_output_is_reduced: the [T, L] latent arrives reduced and must not be summed again."""
    config = dataclasses.replace(SMALL, fused_output_is_reduced=True)
    inputs = make_inputs(config, 4, 5)
    reduced = np.asarray(jnp.asarray(inputs.routed.astype(np.float32).sum(axis=0), config.dtype))
    y = run_tail(config, inputs, make_tp_mesh(4), tier, "column", routed_partials=reduced)
    expected = reference_tail(config, dataclasses.replace(inputs, routed=reduced[None]))
    assert_matches_reference(config, inputs, y, expected)


@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda t: t.value)
def test_tier_on_a_mesh_with_a_data_parallel_axis(tier):
    """Axes other than the TP axis replicate the computation; the result stays replicated."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    inputs = make_inputs(SMALL, 4, 16)
    y = run_tail(SMALL, inputs, mesh, tier, layout_for(tier))
    assert_matches_reference(SMALL, inputs, y)
    assert y.sharding.is_fully_replicated


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto], ids=str)
def test_inputs_in_any_sharding_are_placed(axis_type):
    mesh = make_tp_mesh(8, axis_type)
    inputs = make_inputs(SMALL, 8, 16)
    on_mesh = dict(
        routed_partials=jax.device_put(inputs.routed, NamedSharding(mesh, P(None, "tp"))),
        shared_partials=jax.device_put(inputs.shared, NamedSharding(mesh, P(None, None, "tp"))),
        up_proj_kernel=jax.device_put(inputs.kernel, NamedSharding(mesh, P("tp"))),
    )
    y = run_tail(SMALL, inputs, mesh, k3_tail.Tier.COLUMN_PARALLEL, "column", **on_mesh)
    assert_matches_reference(SMALL, inputs, y)


@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda t: t.value)
def test_tier_works_under_jit(tier):
    mesh = make_tp_mesh(8)
    inputs = make_inputs(SMALL, 8, 16)

    @jax.jit
    def layer(routed, shared, norm_weight, kernel):
        return k3_tail.tail_forward(routed, shared, norm_weight, kernel, config=SMALL, mesh=mesh, tier=tier) * 2

    y = layer(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel)
    assert_matches_reference(SMALL, inputs, y / 2)


def test_caller_arrays_are_not_modified():
    mesh = make_tp_mesh(8)
    inputs = make_inputs(SMALL, 8, 16)
    numpy_copies = {name: value.copy() for name, value in dataclasses.asdict(inputs).items()}
    shared_on_device = jnp.asarray(inputs.shared)
    for tier in k3_tail.Tier:
        run_tail(SMALL, inputs, mesh, tier, layout_for(tier), shared_partials=shared_on_device)
    for name, value in dataclasses.asdict(inputs).items():
        np.testing.assert_array_equal(value, numpy_copies[name], err_msg=name)
    assert not shared_on_device.is_deleted()
    np.testing.assert_array_equal(np.asarray(shared_on_device), numpy_copies["shared"])


def column_buffers(config, inputs, mesh, weight_layout):
    """The per-rank buffers the column tier hands to its final all-reduce: [p, T, H]."""
    tp_size = mesh.shape["tp"]
    kernel = inputs.kernel
    kernel_spec = P()
    if weight_layout == "column":
        width = k3_tail.padded_hidden_size(config.hidden_size, tp_size)
        kernel = np.pad(kernel, [(0, 0), (0, width - config.hidden_size)])
        kernel_spec = P(None, "tp")
    tier = functools.partial(
        k3_tail.column_parallel_tail, config=config, axis_name="tp", weight_layout=weight_layout, defer_all_reduce=True
    )
    buffers = jax.jit(jax.shard_map(
        lambda r, s, g, w: tier(r[0], s[0], g, w)[None],
        mesh=mesh,
        in_specs=(P("tp"), P("tp"), P(), kernel_spec),
        out_specs=P("tp"),
    ))
    place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return np.asarray(
        buffers(
            place(inputs.routed, P("tp")), place(inputs.shared, P("tp")), place(inputs.norm_weight, P()),
            place(kernel, kernel_spec),
        )
    )


@pytest.mark.parametrize("weight_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("base", [SMALL, SMALL_ODD], ids=["H96", "H99"])
@pytest.mark.parametrize("num_tokens", [1, 16, 257])
@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_column_tier_writes_only_its_own_block(tp_size, num_tokens, base, dtype, weight_layout):
    """Rank k's buffer is s_k + latent @ W[:, block k] on block k, and bit-identical s_k elsewhere.

    Two ranks that swapped both weight block and write offset would still sum right; this would not.
    """
    config = dataclasses.replace(base, dtype=dtype)
    inputs = make_inputs(config, tp_size, num_tokens)
    buffers = column_buffers(config, inputs, make_tp_mesh(tp_size), weight_layout)
    assert buffers.shape == inputs.shared.shape and buffers.dtype == inputs.shared.dtype

    latent = reference_latent(config, inputs.routed, inputs.norm_weight)
    block_width = k3_tail.padded_hidden_size(config.hidden_size, tp_size) // tp_size
    for rank in range(tp_size):
        own = slice(rank * block_width, min((rank + 1) * block_width, config.hidden_size))
        others = np.ones(config.hidden_size, bool)
        others[own] = False
        np.testing.assert_array_equal(buffers[rank][:, others], inputs.shared[rank][:, others])
        projection = latent @ inputs.kernel[:, own].astype(np.float64)
        expected_own = inputs.shared[rank][:, own].astype(np.float64) + projection
        assert relative_error(buffers[rank][:, own], expected_own) <= TOLERANCE[config.dtype]
