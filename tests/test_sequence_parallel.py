"""Sequence-parallel output: every tier returns y token-sharded over the TP axis, and right."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import k3_tail
from conftest import make_tp_mesh, tier_layouts
from k3_tail.xla_report import report
from reference import TOLERANCE, make_inputs, reference_tail, relative_error

SP = k3_tail.TailConfig(hidden_size=96, latent_size=64, sequence_parallel=True)
SP_ODD = dataclasses.replace(SP, hidden_size=99)


def run_tail(config, inputs, mesh, tier, weight_layout):
    return k3_tail.tail_forward(
        inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel,
        config=config, mesh=mesh, tier=tier, weight_layout=weight_layout,
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("base", [SP, SP_ODD], ids=["H96", "H99"])
@pytest.mark.parametrize("num_tokens", [8, 16, 264])
@pytest.mark.parametrize("tp_size", [2, 8])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_output_is_token_sharded_and_matches_the_reference(tier, weight_layout, tp_size, num_tokens, base, dtype):
    config = dataclasses.replace(base, dtype=dtype)
    inputs = make_inputs(config, tp_size, num_tokens)
    y = run_tail(config, inputs, make_tp_mesh(tp_size), tier, weight_layout)
    assert y.shape == (num_tokens, config.hidden_size) and y.dtype == config.dtype
    assert y.sharding.spec[0] == "tp"
    assert {shard.data.shape for shard in y.addressable_shards} == {(num_tokens // tp_size, config.hidden_size)}
    assert relative_error(y, reference_tail(config, inputs)) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize("num_tokens", [1, 5, 13])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_tokens_that_p_does_not_divide_are_padded_and_sliced(tier, weight_layout, num_tokens):
    """JAX arrays shard evenly only: the T rows come back whole (replicated), and right."""
    inputs = make_inputs(SP_ODD, 8, num_tokens)
    y = run_tail(SP_ODD, inputs, make_tp_mesh(8), tier, weight_layout)
    assert y.shape == (num_tokens, 99) and y.sharding.is_fully_replicated
    assert relative_error(y, reference_tail(SP_ODD, inputs)) <= TOLERANCE[SP_ODD.dtype]


@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_each_rank_holds_its_own_rows(tier, weight_layout):
    inputs = make_inputs(SP, 4, 8)
    y = run_tail(SP, inputs, make_tp_mesh(4), tier, weight_layout)
    expected = reference_tail(SP, inputs)
    for shard in y.addressable_shards:
        rows = shard.index[0]
        assert relative_error(shard.data, expected[rows]) <= TOLERANCE[SP.dtype]


def module_reference_inputs(module, inputs):
    """``inputs`` with the module's own weights (its kernel without padding columns)."""
    kernel = jnp.asarray(module.up_proj_kernel[...])[:, : module.config.hidden_size]
    return dataclasses.replace(inputs, norm_weight=module.norm_scale[...], kernel=kernel)


def test_empty_batch_returns_empty_output():
    y = run_tail(SP, make_inputs(SP, 8, 0), make_tp_mesh(8), None, "column")
    assert y.shape == (0, 96)


def test_module_returns_token_sharded_output():
    mesh = make_tp_mesh(8)
    module = k3_tail.LatentMoETail(SP, mesh, rngs=nnx.Rngs(0))
    inputs = make_inputs(SP, 8, 16)
    y = module(inputs.routed, inputs.shared)
    assert y.sharding.spec[0] == "tp"
    assert relative_error(y, reference_tail(SP, module_reference_inputs(module, inputs))) <= TOLERANCE[SP.dtype]
    assert "sequence-parallel output" in module.plan(16).reason


def test_sequence_parallel_column_tier_reduce_scatters_instead_of_all_reducing():
    compiled = k3_tail.compile_tail(SP, make_tp_mesh(8), 16, tier=k3_tail.Tier.COLUMN_PARALLEL, weight_layout="column")
    result = report(compiled)
    kinds = [(c.kind, sum(a.elements for a in c.arrays)) for c in result.collectives]
    assert kinds == [("all-reduce", 16 * 64), ("reduce-scatter", 16 * 96)]


def test_dp_axis_replicates_and_tp_axis_shards_tokens():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    inputs = make_inputs(SP, 4, 16)
    y = run_tail(SP, inputs, mesh, k3_tail.Tier.COLUMN_PARALLEL, "column")
    assert y.sharding.spec[0] == "tp"
    assert relative_error(y, reference_tail(SP, inputs)) <= TOLERANCE[SP.dtype]
