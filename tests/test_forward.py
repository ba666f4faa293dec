"""tail_forward's contract beyond the numbers: ValueErrors for bad input, T = 0, no retracing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3_tail
import k3_tail.per_rank
from helpers import make_tp_mesh
from reference import make_inputs

CONFIG = k3_tail.TailConfig(hidden_size=96, latent_size=64)


@pytest.fixture(scope="module")
def mesh():
    return make_tp_mesh(8)


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(CONFIG, 8, 5)


def call(inputs, mesh, /, config=CONFIG, **overrides):
    arguments = dict(
        routed_partials=inputs.routed, shared_partials=inputs.shared, norm_weight=inputs.norm_weight,
        up_proj_kernel=inputs.kernel, config=config, mesh=mesh,
    )
    arguments.update(overrides)  # may replace the mesh too
    return k3_tail.tail_forward(**arguments)


def bfloat16(shape):
    return jnp.zeros(shape, jnp.bfloat16)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"routed_partials": bfloat16((5, 64))}, r"routed_partials: expected a 3-d array \[p, T, L\]"),
        ({"routed_partials": bfloat16((8, 5, 32))}, r"routed_partials: expected shape \(8, 5, 64\)"),
        ({"routed_partials": bfloat16((4, 5, 64))}, r"routed_partials: expected shape \(8, 5, 64\) \(p=8"),
        ({"routed_partials": None}, r"routed_partials: expected a 3-d array"),
        ({"shared_partials": bfloat16((8, 6, 96))}, r"shared_partials: expected shape \(8, 5, 96\)"),
        ({"shared_partials": None}, r"shared_partials: expected an array of shape \(8, 5, 96\)"),
        ({"norm_weight": bfloat16((96,))}, r"norm_weight: expected shape \(64,\)"),
        ({"up_proj_kernel": bfloat16((96, 64))}, r"up_proj_kernel: expected shape \(64, 96\)"),
        ({"routed_partials": jnp.zeros((8, 5, 64), jnp.float32)}, r"routed_partials: expected dtype bfloat16"),
        ({"routed_partials": np.zeros((8, 5, 64), np.float64)},
         r"^routed_partials: expected dtype bfloat16 \(config.dtype\), got float64$"),
        ({"routed_partials": np.zeros((8, 5, 64)).tolist()},
         r"^routed_partials: expected a 3-d array \[p, T, L\], got a list \(not an array: np.asarray makes one\)"),
        ({"shared_partials": np.zeros((8, 5, 96)).tolist()}, r"^shared_partials: expected an array .*got a list"),
        ({"up_proj_kernel": np.zeros((64, 96), np.float32)}, r"up_proj_kernel: expected dtype bfloat16"),
        ({"norm_weight": jnp.ones((64,), jnp.int32)}, r"norm_weight: expected dtype bfloat16"),
        ({"tier": "tier0"}, r"^tier: expected a k3_tail.Tier"),
        ({"weight_layout": "rows"}, r"^weight_layout: expected one of \('column', 'replicated'\)"),
        ({"config": {"hidden_size": 96}}, r"^config: expected a k3_tail.TailConfig"),
        ({"mesh": "tp"}, r"^mesh: expected a jax.sharding.Mesh"),
        ({"axis_name": "model"}, r"^mesh: expected a mesh axis named 'model'"),
    ],
    ids=lambda value: value if isinstance(value, str) and " " not in value else None,
)
def test_bad_input_raises_value_error_naming_the_argument(inputs, mesh, overrides, message):
    with pytest.raises(ValueError, match=message):
        call(inputs, mesh, **overrides)


def test_tp_size_must_match_the_partials(inputs):
    """Eight partials on a 4-rank mesh is a wrong p, not something to reshape."""
    with pytest.raises(ValueError, match=r"routed_partials: expected shape \(4, 5, 64\) \(p=4"):
        call(inputs, make_tp_mesh(4))


def test_shared_partials_must_be_none_without_shared_experts(inputs, mesh):
    with pytest.raises(ValueError, match="^shared_partials: expected None because config.has_shared_experts"):
        call(inputs, mesh, config=dataclasses.replace(CONFIG, has_shared_experts=False))


def test_norm_weight_must_be_none_without_the_norm(inputs, mesh):
    with pytest.raises(ValueError, match="^norm_weight: expected None because config.use_latent_norm"):
        call(inputs, mesh, config=dataclasses.replace(CONFIG, use_latent_norm=False))


def test_reduced_routed_output_takes_one_latent(inputs, mesh):
    config = dataclasses.replace(CONFIG, routed_output_is_reduced=True)
    with pytest.raises(ValueError, match=r"routed_partials: expected a 2-d array \[T, L\]"):
        call(inputs, mesh, config=config)


def test_padded_kernel_is_accepted_only_for_the_column_layout(mesh):
    config = dataclasses.replace(CONFIG, hidden_size=90)
    inputs = make_inputs(config, 8, 5)
    padded = np.pad(inputs.kernel, [(0, 0), (0, 6)])
    y = call(inputs, mesh, config=config, up_proj_kernel=padded, weight_layout="column")
    assert y.shape == (5, 90)
    with pytest.raises(ValueError, match=r"up_proj_kernel: expected shape \(64, 90\)"):
        call(inputs, mesh, config=config, up_proj_kernel=padded, weight_layout="replicated")


@pytest.mark.parametrize("tier", [None, *k3_tail.Tier], ids=lambda t: "selected" if t is None else t.value)
def test_empty_batch_returns_empty_output(mesh, tier):
    y = call(make_inputs(CONFIG, 8, 0), mesh, tier=tier)
    assert y.shape == (0, 96) and y.dtype == jnp.bfloat16


def test_selection_runs_at_trace_time_and_a_second_call_does_not_retrace(inputs, mesh, monkeypatch):
    # A threshold no other test uses, so this config meets a cold compilation cache.
    config = dataclasses.replace(CONFIG, overlap_token_threshold=77)
    decisions = []
    rules_select = k3_tail.selection.rules.VllmRules.select

    def recording_select(*args, **kwargs):
        decisions.append(rules_select(*args, **kwargs))
        return decisions[-1]

    monkeypatch.setattr(k3_tail.selection.rules.VllmRules, "select", recording_select)
    first = call(inputs, mesh, config=config)
    second = call(inputs, mesh, config=config)
    assert [d.tier for d in decisions] == [k3_tail.Tier.OVERLAP]
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    call(make_inputs(config, 8, 78), mesh, config=config)
    assert [d.tier for d in decisions] == [k3_tail.Tier.OVERLAP, k3_tail.Tier.COLUMN_PARALLEL]


def test_output_is_replicated_on_the_mesh(inputs, mesh):
    y = call(inputs, mesh)
    assert y.sharding.is_fully_replicated
    assert {shard.data.shape for shard in y.addressable_shards} == {(5, 96)}
    assert len(y.addressable_shards) == jax.device_count() >= 8
