"""The shared reduction issued before the tail: k3_tail.reduce_shared and TailConfig(shared_output_is_reduced).

Parity of every tier and layout in this mode runs in the covering design (tests/covering.py, the factor
``shared_output_is_reduced``) and in a model's own shard_map (tests/test_per_rank.py); here: what
reduce_shared returns, what the tail does with its result (no collective on it), how selection, the
cost model and measured tables know the mode, and bad input.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from helpers import make_tp_mesh, reduced_shared
from k3_tail.selection import cost_model
from reference import TOLERANCE, make_inputs, reference_tail, relative_error

CONFIG = k3_tail.TailConfig(hidden_size=96, latent_size=64, dtype=jnp.float32)
REDUCED = dataclasses.replace(CONFIG, shared_output_is_reduced=True)


def reduce_on_mesh(config, partials, *, out_spec, device=None):
    """k3_tail.reduce_shared of the [p, T, H] partials, rank i reducing entry i, inside a shard_map."""
    mesh = make_tp_mesh(partials.shape[0])
    reduce = jax.shard_map(lambda x: k3_tail.reduce_shared(x[0], config=config, device=device), mesh=mesh,
                           in_specs=P("tp"), out_specs=out_spec)
    return reduce(jax.device_put(jnp.asarray(partials), NamedSharding(mesh, P("tp"))))


def test_reduce_shared_is_the_sum_of_the_partials_on_every_rank():
    partials = make_inputs(REDUCED, 4, 5).shared
    summed = reduce_on_mesh(REDUCED, partials, out_spec=P())
    assert summed.shape == (5, 96) and summed.sharding.is_fully_replicated
    assert relative_error(summed, partials.astype(np.float64).sum(axis=0)) <= TOLERANCE[REDUCED.dtype]


def test_reduce_shared_with_sequence_parallel_output_is_each_ranks_rows_of_the_padded_sum():
    """T = 5 on p = 4: the sum padded with zero rows to 8, rank k holding rows [2k, 2k + 2)."""
    config = dataclasses.replace(REDUCED, sequence_parallel=True)
    partials = make_inputs(config, 4, 5).shared
    rows = reduce_on_mesh(config, partials, out_spec=P("tp"))
    assert {shard.data.shape for shard in rows.addressable_shards} == {(2, 96)}
    expected = np.concatenate([partials.astype(np.float64).sum(axis=0), np.zeros((3, 96))])
    np.testing.assert_allclose(np.asarray(rows), expected, rtol=1e-5, atol=1e-6)


def test_the_tail_puts_no_collective_on_a_reduced_shared_output():
    """On the CPU mesh: the compiled tail moves only the latent's sum (the overlap tier would move T*H too)."""
    mesh = make_tp_mesh(4)
    inputs = make_inputs(REDUCED, 4, 5)
    compiled = jax.jit(lambda *a: k3_tail.tail_forward(*a, config=REDUCED, mesh=mesh, tier="overlap")).lower(
        inputs.routed, reduced_shared(REDUCED, inputs.shared), inputs.norm_weight, inputs.kernel).compile()
    result = k3_tail.xla.report.report(compiled)
    assert [(c.kind, c.scopes) for c in result.collectives] == [("all-reduce", ("latent_reduction",))]


@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda tier: tier.value)
def test_each_tiers_record_drops_the_shared_sum_from_its_collectives(tier):
    """The cost terms: fewer wire bytes (no sum of the shared partials); one_shot's packed buffer is T(H + L)."""
    layout = "column" if tier.supports("column") else "replicated"
    before = cost_model.tier_cost(CONFIG, 16, 4, tier=tier, weight_layout=layout)
    after = cost_model.tier_cost(REDUCED, 16, 4, tier=tier, weight_layout=layout)
    assert sum(c.wire_bytes for c in after.collectives) < sum(c.wire_bytes for c in before.collectives)
    if tier is k3_tail.Tier.ONE_SHOT:
        assert [c.buffer_bytes for c in after.collectives] == [4 * 16 * (96 + 64)]
    assert tier.record.prose.shared_reduced_form


def test_vllm_policy_runs_native_where_overlap_would_have_nothing_to_hide():
    decision = k3_tail.select_tier(REDUCED, 16, 8)
    assert decision.tier is k3_tail.Tier.NATIVE
    assert "shared_output_is_reduced is True" in decision.reason and "nothing to hide" in decision.reason
    assert k3_tail.select_tier(REDUCED, 300, 8).tier is k3_tail.Tier.COLUMN_PARALLEL


def test_the_reason_says_how_the_selected_tier_runs_with_a_reduced_shared_output():
    decision = k3_tail.select_tier(REDUCED, 300, 8)
    assert decision.reason.endswith(f"shared output reduced before the tail: "
                                    f"{k3_tail.Tier.COLUMN_PARALLEL.record.prose.shared_reduced_form}")


def test_model_policy_prices_the_mode():
    """Without the shared all-reduce, the column tier's final collective is an all-gather (half the bytes)."""
    config = dataclasses.replace(REDUCED, selection_policy=cost_model.CostModelPolicy("mi355x"))
    cost = cost_model.tier_cost(config, 4096, 8, tier="column_parallel", weight_layout="column")
    assert [c.kind for c in cost.collectives] == ["all-reduce", "all-gather"]
    assert "predicted fastest on mi355x" in k3_tail.select_tier(config, 4096, 8, weight_layout="column").reason


def test_a_measured_table_refuses_the_other_mode():
    table = k3_tail.SelectionTable(device_kind="cpu", tp_size=8, weight_layout="column", hidden_size=96,
                                   latent_size=64, dtype="float32",
                                   ranges=(k3_tail.selection.table.TokenRange(1, None, k3_tail.Tier.OVERLAP),))
    table.check_matches(CONFIG, 8, weight_layout="column", device_kind="cpu")
    with pytest.raises(ValueError, match=r"^selection_table: measured with shared_output_is_reduced=False"):
        table.check_matches(REDUCED, 8, weight_layout="column", device_kind="cpu")
    assert k3_tail.SelectionTable.from_dict(table.to_dict()) == table
    older = {key: value for key, value in table.to_dict().items() if key != "shared_output_is_reduced"}
    assert k3_tail.SelectionTable.from_dict(older).shared_output_is_reduced is False  # measured with the partials


def test_the_global_api_takes_the_reduced_shared_output_whole():
    inputs = make_inputs(REDUCED, 4, 5)
    y = k3_tail.tail_forward(inputs.routed, reduced_shared(REDUCED, inputs.shared), inputs.norm_weight,
                             inputs.kernel, config=REDUCED, mesh=make_tp_mesh(4), tier="scatter_gather",
                             weight_layout="column")
    assert relative_error(y, reference_tail(REDUCED, inputs)) <= TOLERANCE[REDUCED.dtype]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: k3_tail.reduce_shared(jnp.zeros((3, 96)), config=CONFIG),
         r"^axis_name: 'tp' is not a mesh axis here; call reduce_shared inside jax.shard_map"),
        (lambda: reduce_on_mesh(REDUCED, np.zeros((4, 3, 95), np.float32), out_spec=P()),
         r"^shared_partial: expected shape \(3, 96\) \(H=96\)"),
        (lambda: reduce_on_mesh(REDUCED, np.zeros((4, 3, 96), jnp.bfloat16), out_spec=P()),
         r"^shared_partial: expected dtype float32"),
        (lambda: reduce_on_mesh(CONFIG, np.zeros((4, 3, 96), np.float32), out_spec=P()),
         r"^config: shared_output_is_reduced is False, so the tail takes the shared partials"),
        (lambda: reduce_on_mesh(dataclasses.replace(CONFIG, has_shared_experts=False), np.zeros((4, 3, 96)),
                                out_spec=P()),
         r"^config: has_shared_experts is False"),
        (lambda: k3_tail.tail_forward(*(lambda i: (i.routed, i.shared, i.norm_weight, i.kernel))(
            make_inputs(REDUCED, 4, 5)), config=REDUCED, mesh=make_tp_mesh(4)),
         r"^shared_partials: expected shape \(5, 96\) \(the reduced shared output"),
        (lambda: reduce_on_mesh(REDUCED, np.zeros((4, 3, 96), np.float32), out_spec=P(), device="gpu"),
         r"^device: expected a jax.Device .* or None, got 'gpu'"),
    ],
    ids=["no-axis", "shared-width", "shared-dtype", "unreduced-config", "no-shared-experts", "global-partials",
         "device-name"],
)
def test_bad_input_is_a_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
