"""LatentMoETail: parameters and their sharding per weight layout, parity, plan, no retracing."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import k3_tail
from helpers import make_tp_mesh, pairwise_params, tier_supports_layout
from reference import TOLERANCE, TailInputs, make_inputs, reference_tail, relative_error

CONFIG = k3_tail.TailConfig(hidden_size=96, latent_size=64)
ODD = dataclasses.replace(CONFIG, hidden_size=90)


def module_inputs(module, num_tokens, seed=0):
    """Random partials with the module's own weights, as reference inputs (kernel sliced to [L, H])."""
    config = module.config
    partials = make_inputs(config, module.tp_size, num_tokens, seed)
    kernel = np.asarray(module.up_proj_kernel[...])[:, : config.hidden_size]
    norm = np.asarray(module.norm_scale[...]) if module.norm_scale is not None else None
    return TailInputs(partials.routed, partials.shared, norm, kernel)


@pytest.mark.parametrize("config", [CONFIG, ODD], ids=["H96", "H90"])
@pytest.mark.parametrize("tp_size", [2, 8])
def test_column_layout_stores_one_block_per_device(tp_size, config):
    module = k3_tail.LatentMoETail(config, make_tp_mesh(tp_size), rngs=nnx.Rngs(0), weight_layout="column")
    kernel = module.up_proj_kernel[...]
    width = k3_tail.padded_hidden_size(config.hidden_size, tp_size)
    assert kernel.shape == (64, width)
    assert kernel.sharding.spec == P(None, "tp")
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(64, width // tp_size)}
    np.testing.assert_array_equal(np.asarray(kernel)[:, config.hidden_size:], 0)


def test_replicated_layout_stores_the_whole_kernel_on_every_device():
    module = k3_tail.LatentMoETail(CONFIG, make_tp_mesh(8), rngs=nnx.Rngs(0), weight_layout="replicated")
    kernel = module.up_proj_kernel[...]
    assert kernel.shape == (64, 96)
    assert kernel.sharding.is_fully_replicated
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(64, 96)}


@pytest.mark.parametrize("weight_layout", k3_tail.ops.columns.WEIGHT_LAYOUTS)
def test_parameters_carry_sharding_metadata(weight_layout):
    module = k3_tail.LatentMoETail(CONFIG, make_tp_mesh(8), rngs=nnx.Rngs(0), weight_layout=weight_layout)
    specs = nnx.get_partition_spec(nnx.state(module, nnx.Param))
    expected = P(None, "tp") if weight_layout == "column" else P(None, None)
    assert specs["up_proj_kernel"].get_value() == expected
    assert specs["norm_scale"].get_value() == P(None)


def test_norm_scale_starts_at_one_and_is_absent_without_the_norm():
    module = k3_tail.LatentMoETail(CONFIG, make_tp_mesh(2), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(module.norm_scale[...], np.float32), 1)
    without = k3_tail.LatentMoETail(dataclasses.replace(CONFIG, use_latent_norm=False), make_tp_mesh(2),
                                    rngs=nnx.Rngs(0))
    assert without.norm_scale is None


def layout_case_id(values):
    tier, weight_layout, config = values
    return f"{tier.value}-{weight_layout}-H{config.hidden_size}"


# Every pair of tier, layout and H (divisible by p = 8 or not); the whole product with ``pytest -m slow``.
LAYOUT_CASES = pairwise_params({"tier": tuple(k3_tail.Tier), "weight_layout": ("column", "replicated"),
                                "config": (CONFIG, ODD)}, layout_case_id, tier_supports_layout)


@pytest.mark.parametrize(("tier", "weight_layout", "config"), LAYOUT_CASES)
def test_every_tier_works_with_both_layouts(tier, weight_layout, config):
    module = k3_tail.LatentMoETail(config, make_tp_mesh(8), rngs=nnx.Rngs(0), weight_layout=weight_layout)
    inputs = module_inputs(module, 16)
    y = module(inputs.routed, inputs.shared, tier=tier)
    assert y.shape == (16, config.hidden_size) and y.dtype == config.dtype
    assert relative_error(y, reference_tail(config, inputs)) <= TOLERANCE[config.dtype]


def test_plan_reports_the_selected_tier_and_reason():
    module = k3_tail.LatentMoETail(CONFIG, make_tp_mesh(8), rngs=nnx.Rngs(0))
    device = module.mesh.devices.flat[0]
    assert module.plan(256) == k3_tail.select_tier(CONFIG, 256, 8, weight_layout="column",
                                                   device_kind=device.device_kind, platform=device.platform)
    assert module.plan(257).tier == k3_tail.Tier.COLUMN_PARALLEL
    assert "overlap_token_threshold" in module.plan(257).reason


def test_module_runs_under_nnx_jit_without_retracing():
    config = dataclasses.replace(CONFIG, overlap_token_threshold=33)  # a config no other test compiles
    module = k3_tail.LatentMoETail(config, make_tp_mesh(8), rngs=nnx.Rngs(0))
    traces = []

    @nnx.jit
    def layer(module, routed, shared):
        traces.append(routed.shape)
        return module(routed, shared)

    inputs = module_inputs(module, 5)
    first = layer(module, inputs.routed, inputs.shared)
    second = layer(module, inputs.routed, inputs.shared)
    assert traces == [(8, 5, 64)]
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    assert relative_error(first, reference_tail(config, inputs)) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weight_layout": "rows"}, "^weight_layout: expected"),
        ({"axis_name": "model"}, "^mesh: expected a mesh axis named 'model'"),
        ({"rngs": 0}, r"^rngs: expected a flax.nnx.Rngs \(nnx.Rngs\(0\)\), got int"),
    ],
)
def test_bad_construction_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        k3_tail.LatentMoETail(CONFIG, make_tp_mesh(2), **{"rngs": nnx.Rngs(0), **kwargs})


def test_bad_call_input_names_the_argument():
    module = k3_tail.LatentMoETail(CONFIG, make_tp_mesh(8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"shared_partials: expected shape \(8, 5, 96\)"):
        module(jnp.zeros((8, 5, 64), jnp.bfloat16), jnp.zeros((8, 5, 64), jnp.bfloat16))
