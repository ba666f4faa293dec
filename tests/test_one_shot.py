"""The one-collective tier: its restrictions and its single collective (parity is in test_tiers.py)."""

import dataclasses

import pytest

import k3_tail
from helpers import make_tp_mesh
from k3_tail.xla.report import report
from reference import make_inputs

CONFIG = k3_tail.TailConfig(hidden_size=96, latent_size=64)


def test_column_layout_is_a_value_error_naming_the_weight_layout():
    inputs = make_inputs(CONFIG, 4, 5)
    with pytest.raises(ValueError, match=r"^tier: one_shot needs the whole \[L, H\] kernel on every rank"):
        k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=CONFIG,
                             mesh=make_tp_mesh(4), tier="one_shot", weight_layout="column")


def test_an_already_reduced_routed_output_is_a_value_error():
    config = dataclasses.replace(CONFIG, routed_output_is_reduced=True)
    inputs = make_inputs(config, 4, 5)
    with pytest.raises(ValueError, match="tier: one_shot reduces the routed partials itself"):
        k3_tail.tail_forward(inputs.routed.sum(axis=0), inputs.shared, inputs.norm_weight, inputs.kernel,
                             config=config, mesh=make_tp_mesh(4), tier="one_shot")


@pytest.mark.parametrize(
    ("changes", "width"),
    [({}, 2 * 96 + 64), ({"has_shared_experts": False}, 96 + 64), ({"use_latent_norm": False}, 2 * 96)],
    ids=["shared_and_norm", "no_shared", "no_norm"],
)
def test_one_all_reduce_of_the_packed_buffer_is_the_only_collective(changes, width):
    config = dataclasses.replace(CONFIG, **changes)
    compiled = k3_tail.compile_tail(config, make_tp_mesh(8), 16, tier="one_shot")
    result = report(compiled, shared_argument=1 if config.has_shared_experts else None)
    assert [(c.kind, sum(a.elements for a in c.arrays)) for c in result.collectives] == [("all-reduce", 16 * width)]


def test_every_rank_runs_the_full_gemm():
    result = report(k3_tail.compile_tail(CONFIG, make_tp_mesh(8), 16, tier="one_shot"))
    assert result.gemm_flops == 2 * 16 * 64 * 96


def test_not_in_the_demo_column_layout_tiers():
    assert not k3_tail.Tier.ONE_SHOT.supports("column") and k3_tail.Tier.ONE_SHOT.supports("replicated")
