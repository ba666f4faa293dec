"""Sequence-parallel output: every tier returns y token-sharded over the TP axis, for every T, and right.

JAX arrays shard evenly only, so y comes back padded to T' = padded_token_count(T, p) rows: [T', H],
rank k holding rows [k*T'/p, (k+1)*T'/p), rows T..T'-1 zero (helpers.token_sharded_rows checks that
form). The parity cases are the sequence-parallel half of the covering design (tests/covering.py),
which runs T both divisible by p and not at every p > 1, and T = 0.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from covering import DIVISIBLE_HIDDEN_SIZE, LATENT_SIZE, TAIL_CASES
from helpers import make_tp_mesh, preferred_tier_layouts, run_case, token_sharded_rows
from reference import TOLERANCE, TailInputs, make_inputs, reference_tail, relative_error, tolerance

SP = k3_tail.TailConfig(hidden_size=DIVISIBLE_HIDDEN_SIZE, latent_size=LATENT_SIZE, sequence_parallel=True)
SEQUENCE_PARALLEL_CASES = [case for case in TAIL_CASES if case.sequence_parallel]


def run_tail(config, inputs, mesh, tier, weight_layout):
    return k3_tail.tail_forward(
        inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel,
        config=config, mesh=mesh, tier=tier, weight_layout=weight_layout,
    )


@pytest.mark.parametrize("case", SEQUENCE_PARALLEL_CASES, ids=lambda case: case.id)
def test_output_is_the_token_sharded_padded_rows_and_matches_the_reference(case):
    """[T', H], [T'/p, H] per rank, zero padding rows, the first T rows right; T = 0: p zero rows."""
    config, inputs, y = run_case(case)
    rows = token_sharded_rows(y, config, case.num_tokens, case.tp_size)
    if case.num_tokens:
        assert relative_error(rows, reference_tail(config, inputs)) <= tolerance(config, inputs)


def test_the_covering_design_runs_padded_rows_for_every_tier():
    """The parity cases above include, for every tier, a T that p does not divide."""
    padded = {case.tier for case in SEQUENCE_PARALLEL_CASES if case.num_tokens % case.tp_size}
    assert {tier.value for tier in k3_tail.Tier} <= padded


@pytest.mark.parametrize(("tier", "weight_layout"), preferred_tier_layouts())
def test_each_rank_holds_its_own_rows(tier, weight_layout):
    """Rank k's shard is rows [k*T/p, (k+1)*T/p) of y: the shards are not merely right in sum."""
    inputs = make_inputs(SP, 4, 8)
    y = run_tail(SP, inputs, make_tp_mesh(4), tier, weight_layout)
    expected = reference_tail(SP, inputs)
    for shard in y.addressable_shards:
        rows = shard.index[0]
        assert relative_error(shard.data, expected[rows]) <= TOLERANCE[SP.dtype]


README_CONFIG = k3_tail.TailConfig(hidden_size=100, latent_size=64, sequence_parallel=True)


@pytest.mark.parametrize("shared_output_is_reduced", [False, True], ids=["shared-partials", "shared-reduced-early"])
def test_the_readme_layer_with_out_specs_p_tp_at_t13_on_8_ranks(shared_output_is_reduced):
    """The README's moe_layer (and moe_layer_early) with sequence_parallel=True and out_specs=P("tp") at T = 13,
    p = 8: y is [16, H], its first 13 rows the float64 reference's and the 3 padding rows zero, never the 13
    rows stacked 8 times."""
    config = dataclasses.replace(README_CONFIG, shared_output_is_reduced=shared_output_is_reduced)
    mesh = make_tp_mesh(8)
    p, T, L, H = 8, 13, config.latent_size, config.hidden_size
    F, Fs = 8 * p, 4 * p
    rng = np.random.default_rng(0)

    def draw(*shape, scale=1.0, shift=0.0):  # in the config's dtype, kept as float64 for the reference
        return np.asarray(jnp.asarray(shift + scale * rng.standard_normal(shape), config.dtype), np.float64)

    expert_act, down_proj = draw(T, F), draw(F, L, scale=F ** -0.5)
    shared_act, shared_down = draw(T, Fs), draw(Fs, H, scale=Fs ** -0.5)
    norm_weight, up_proj = draw(L, scale=0.1, shift=1.0), draw(L, H, scale=L ** -0.5)
    padded = np.pad(up_proj, ((0, 0), (0, k3_tail.padded_hidden_size(H, p) - H)))

    def moe_layer(expert_act, down_proj, shared_act, shared_down, norm_weight, up_proj_kernel):
        routed = expert_act @ down_proj
        shared = shared_act @ shared_down
        if config.shared_output_is_reduced:
            shared = k3_tail.reduce_shared(shared, config=config, axis_name="tp")
        return k3_tail.latent_moe_tail(routed, shared, norm_weight, up_proj_kernel,
                                       config=config, axis_name="tp", weight_layout="column")

    specs = (P(None, "tp"), P("tp"), P(None, "tp"), P("tp"), P(), P(None, "tp"))
    layer = jax.jit(jax.shard_map(moe_layer, mesh=mesh, out_specs=P("tp"), in_specs=specs))
    arrays = (expert_act, down_proj, shared_act, shared_down, norm_weight, padded)
    y = layer(*(jax.device_put(jnp.asarray(x, config.dtype), NamedSharding(mesh, spec))
                for x, spec in zip(arrays, specs, strict=True)))

    assert y.shape == (16, H)
    full = TailInputs((expert_act @ down_proj)[None], (shared_act @ shared_down)[None], norm_weight, up_proj)
    rows = token_sharded_rows(y, config, T, p)
    assert relative_error(rows, reference_tail(config, full)) <= TOLERANCE[config.dtype]


def test_the_module_returns_the_same_token_sharded_rows_globally_and_per_rank():
    """LatentMoETail with sequence_parallel at T = 13 on 8 ranks: __call__ and per_rank (out_specs P("tp")) both
    give the [16, H] padded rows, right, and its plan names the padding."""
    mesh = make_tp_mesh(8)
    module = k3_tail.LatentMoETail(SP, mesh, rngs=nnx.Rngs(0))
    inputs = make_inputs(SP, 8, 13)
    state_specs = nnx.StateSharding(nnx.get_partition_spec(nnx.state(module)))

    @nnx.shard_map(mesh=mesh, in_specs=(state_specs, P("tp"), P("tp")), out_specs=P("tp"))
    def layer(module, routed, shared):
        return module.per_rank(routed[0], shared[0])

    y_global = module(inputs.routed, inputs.shared)
    y_per_rank = layer(module, *(jax.device_put(x, NamedSharding(mesh, P("tp"))) for x in (inputs.routed,
                                                                                            inputs.shared)))
    kernel = jnp.asarray(module.up_proj_kernel[...])[:, : SP.hidden_size]
    expected = reference_tail(SP, dataclasses.replace(inputs, norm_weight=module.norm_scale[...], kernel=kernel))
    for y in (y_global, y_per_rank):
        assert relative_error(token_sharded_rows(y, SP, 13, 8), expected) <= TOLERANCE[SP.dtype]
    assert "padded with zero rows to T'=16" in module.plan(13).reason


def test_sequence_parallel_column_tier_reduce_scatters_instead_of_all_reducing():
    """The column tier's final [T, H] all-reduce becomes a reduce-scatter; the latent all-reduce stays."""
    compiled = k3_tail.compile_tail(SP, make_tp_mesh(8), 16, tier=k3_tail.Tier.COLUMN_PARALLEL, weight_layout="column")
    result = k3_tail.xla.report.report(compiled)
    kinds = [(c.kind, sum(a.elements for a in c.arrays)) for c in result.collectives]
    assert kinds == [("all-reduce", 16 * 64), ("reduce-scatter", 16 * 96)]


def test_a_padded_call_gathers_nothing():
    """T = 13 on 8 ranks: the padded rows stay sharded, so the program has no all-gather."""
    compiled = k3_tail.compile_tail(SP, make_tp_mesh(8), 13, tier=k3_tail.Tier.COLUMN_PARALLEL, weight_layout="column")
    kinds = [(c.kind, sum(a.elements for a in c.arrays)) for c in k3_tail.xla.report.report(compiled).collectives]
    assert kinds == [("all-reduce", 16 * 64), ("reduce-scatter", 16 * 96)]


def test_dp_axis_replicates_and_tp_axis_shards_tokens():
    """On a (dp, tp) mesh the tokens are sharded over tp only, padded to a multiple of p = 4 (T = 14: 16 rows)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    inputs = make_inputs(SP, 4, 14)
    y = run_tail(SP, inputs, mesh, k3_tail.Tier.COLUMN_PARALLEL, "column")
    assert y.sharding.spec[0] == "tp"
    assert relative_error(token_sharded_rows(y, SP, 14, 4), reference_tail(SP, inputs)) <= TOLERANCE[SP.dtype]


@pytest.mark.parametrize(("num_tokens", "tp_size", "argument"), [(-3, 2, "num_tokens"), (5, 0, "tp_size"),
                                                                 (5.0, 2, "num_tokens"), (5, True, "tp_size")])
def test_padded_token_count_refuses_what_is_no_count_naming_it(num_tokens, tp_size, argument):
    with pytest.raises(ValueError, match=f"^{argument}: expected an integer >= "):
        k3_tail.padded_token_count(num_tokens, tp_size)
