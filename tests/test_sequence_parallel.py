"""Sequence-parallel output: every tier returns y token-sharded over the TP axis, and right.

JAX arrays shard evenly only: when p does not divide T the tokens are padded for the tier and the T
rows come back whole (replicated). The parity cases are the sequence-parallel half of the covering
design (tests/covering.py), which runs both forms at every p > 1.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import k3_tail
from covering import DIVISIBLE_HIDDEN_SIZE, LATENT_SIZE, TAIL_CASES
from helpers import make_tp_mesh, run_case, tier_layouts
from reference import TOLERANCE, make_inputs, reference_tail, relative_error, tolerance

SP = k3_tail.TailConfig(hidden_size=DIVISIBLE_HIDDEN_SIZE, latent_size=LATENT_SIZE, sequence_parallel=True)
SEQUENCE_PARALLEL_CASES = [case for case in TAIL_CASES if case.sequence_parallel]


def run_tail(config, inputs, mesh, tier, weight_layout):
    return k3_tail.tail_forward(
        inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel,
        config=config, mesh=mesh, tier=tier, weight_layout=weight_layout,
    )


@pytest.mark.parametrize("case", SEQUENCE_PARALLEL_CASES, ids=lambda case: case.id)
def test_output_is_token_sharded_when_p_divides_t_and_matches_the_reference(case):
    """Each rank holds [T/p, H] when p divides T, else every rank holds all T rows; y is right either way.

    An empty batch (T = 0) only has to come back as an empty [0, H] of the config's dtype.
    """
    config, inputs, y = run_case(case)
    num_tokens, hidden_size, tp_size = case.num_tokens, case.hidden_size, case.tp_size
    assert y.shape == (num_tokens, hidden_size) and y.dtype == config.dtype
    if not num_tokens:
        return
    if num_tokens % tp_size == 0:
        assert y.sharding.spec[0] == "tp"
        assert {shard.data.shape for shard in y.addressable_shards} == {(num_tokens // tp_size, hidden_size)}
    else:
        assert y.sharding.is_fully_replicated
        assert {shard.data.shape for shard in y.addressable_shards} == {(num_tokens, hidden_size)}
    assert relative_error(y, reference_tail(config, inputs)) <= tolerance(config, inputs)


@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_each_rank_holds_its_own_rows(tier, weight_layout):
    """Rank k's shard is rows [k*T/p, (k+1)*T/p) of y: the shards are not merely right in sum."""
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


def test_module_returns_token_sharded_output():
    """LatentMoETail with sequence_parallel=True returns token-sharded y, and its plan says so."""
    mesh = make_tp_mesh(8)
    module = k3_tail.LatentMoETail(SP, mesh, rngs=nnx.Rngs(0))
    inputs = make_inputs(SP, 8, 16)
    y = module(inputs.routed, inputs.shared)
    assert y.sharding.spec[0] == "tp"
    assert relative_error(y, reference_tail(SP, module_reference_inputs(module, inputs))) <= TOLERANCE[SP.dtype]
    assert "sequence-parallel output" in module.plan(16).reason


def test_sequence_parallel_column_tier_reduce_scatters_instead_of_all_reducing():
    """The column tier's final [T, H] all-reduce becomes a reduce-scatter; the latent all-reduce stays."""
    compiled = k3_tail.compile_tail(SP, make_tp_mesh(8), 16, tier=k3_tail.Tier.COLUMN_PARALLEL, weight_layout="column")
    result = k3_tail.xla.report.report(compiled)
    kinds = [(c.kind, sum(a.elements for a in c.arrays)) for c in result.collectives]
    assert kinds == [("all-reduce", 16 * 64), ("reduce-scatter", 16 * 96)]


def test_dp_axis_replicates_and_tp_axis_shards_tokens():
    """On a (dp, tp) mesh the tokens are sharded over tp only."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    inputs = make_inputs(SP, 4, 16)
    y = run_tail(SP, inputs, mesh, k3_tail.Tier.COLUMN_PARALLEL, "column")
    assert y.sharding.spec[0] == "tp"
    assert relative_error(y, reference_tail(SP, inputs)) <= TOLERANCE[SP.dtype]
