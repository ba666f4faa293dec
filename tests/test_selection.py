"""select_tier: vLLM's rule order, a reason for every outcome, and no silent fallback."""

import dataclasses

import jax
import pytest

from k3_tail import SelectionTable, TailConfig, Tier, select_tier
from k3_tail.hardware import check_device_kind, device_platform
from k3_tail.selection.cost_model import CostModelPolicy
from k3_tail.selection.rules import VllmRules, gpu_rules_note
from k3_tail.selection.table import TokenRange

K3 = TailConfig.kimi_k3()


@pytest.mark.parametrize("tp_size", [4, 8, 16])
@pytest.mark.parametrize("num_tokens, tier", [(1, Tier.OVERLAP), (256, Tier.OVERLAP), (257, Tier.COLUMN_PARALLEL),
                                              (8192, Tier.COLUMN_PARALLEL)])
def test_threshold_boundary(num_tokens, tier, tp_size):
    decision = select_tier(K3, num_tokens, tp_size)
    assert decision.tier == tier
    assert f"T={num_tokens}" in decision.reason and "overlap_token_threshold=256" in decision.reason


def test_threshold_comes_from_the_config():
    config = dataclasses.replace(K3, overlap_token_threshold=16)
    assert select_tier(config, 16, 8).tier == Tier.OVERLAP
    assert select_tier(config, 17, 8).tier == Tier.COLUMN_PARALLEL


def test_disable_switch_forces_the_column_tier():
    decision = select_tier(dataclasses.replace(K3, disable_overlap=True), 5, 8)
    assert decision.tier == Tier.COLUMN_PARALLEL
    assert "disable_overlap is True" in decision.reason


@pytest.mark.parametrize(
    "changes, tp_size, reason",
    [
        ({}, 1, "tp_size == 1"),
        ({"has_shared_experts": False}, 8, "has_shared_experts is False"),
        ({"routed_output_is_reduced": True}, 8, "routed_output_is_reduced is True"),
    ],
    ids=["no_tp", "no_shared", "already_reduced"],
)
@pytest.mark.parametrize("num_tokens", [5, 1024])
def test_broken_precondition_selects_native_and_names_it(changes, tp_size, reason, num_tokens):
    decision = select_tier(dataclasses.replace(K3, **changes), num_tokens, tp_size)
    assert decision.tier == Tier.NATIVE
    assert decision.reason.startswith(reason)


def test_scale_other_than_one_keeps_the_fast_tiers():
    """Every tier honours routed_scaling_factor, so unlike vLLM's ROCm runner it is no precondition."""
    config = dataclasses.replace(K3, routed_scaling_factor=2.5)
    assert select_tier(config, 5, 8).tier == Tier.OVERLAP
    assert select_tier(config, 1024, 8).tier == Tier.COLUMN_PARALLEL


def test_empty_batch_selects_native_with_a_reason():
    decision = select_tier(K3, 0, 8)
    assert decision.tier == Tier.NATIVE and "num_tokens == 0" in decision.reason


@pytest.mark.parametrize("num_tokens, tier", [(1, Tier.SCATTER_GATHER), (128, Tier.SCATTER_GATHER),
                                              (129, Tier.OVERLAP), (257, Tier.COLUMN_PARALLEL)])
def test_scatter_gather_tier_when_enabled(num_tokens, tier):
    decision = select_tier(dataclasses.replace(K3, use_scatter_gather=True), num_tokens, 8)
    assert decision.tier == tier


def test_hidden_not_divisible_keeps_the_column_tier_and_says_it_pads():
    decision = select_tier(dataclasses.replace(K3, hidden_size=7170), 1024, 8)
    assert decision.tier == Tier.COLUMN_PARALLEL
    assert "not divisible by tp_size=8" in decision.reason and "padded to 7176" in decision.reason


def test_decision_prints_tier_and_reason():
    assert str(select_tier(K3, 1024, 8)).startswith("column_parallel: T=1024 >")


@pytest.mark.parametrize(
    "args, argument",
    [(("config", 5, 8), "config"), ((K3, -1, 8), "num_tokens"), ((K3, 5, 0), "tp_size"), ((K3, 5.0, 8), "num_tokens")],
)
def test_bad_arguments_raise_value_error(args, argument):
    with pytest.raises(ValueError, match=f"^{argument}:"):
        select_tier(*args)


@pytest.mark.parametrize("text, tier", [("overlap", Tier.OVERLAP), ("COLUMN_PARALLEL", Tier.COLUMN_PARALLEL),
                                        (Tier.NATIVE, Tier.NATIVE)])
def test_tier_parses_values_and_names(text, tier):
    assert Tier.parse(text) is tier


def test_tier_parse_rejects_unknown_names():
    with pytest.raises(ValueError, match="^tier: expected a k3_tail.Tier or one of 'native'"):
        Tier.parse("tier0")


@pytest.mark.parametrize(
    "changes, num_tokens, tier, form",
    [
        ({}, 16, Tier.OVERLAP, "AR(s) becomes a reduce-scatter over tokens"),
        ({}, 1024, Tier.COLUMN_PARALLEL, "the final AR becomes a reduce-scatter over tokens"),
        ({"use_scatter_gather": True}, 16, Tier.SCATTER_GATHER, "all-gather over columns becomes an all-to-all"),
    ],
    ids=["overlap", "column_parallel", "scatter_gather"],
)
def test_sequence_parallel_keeps_the_fast_tiers_and_says_how_they_shard_tokens(changes, num_tokens, tier, form):
    decision = select_tier(dataclasses.replace(K3, sequence_parallel=True, **changes), num_tokens, 8)
    assert decision.tier == tier
    assert "; sequence-parallel output: " in decision.reason and form in decision.reason
    assert "padded" not in decision.reason


@pytest.mark.parametrize(("num_tokens", "why", "padding"), [(5, "is not divisible by tp_size=8", "from 5 on"),
                                                           (0, "is empty", "from 0 on")])
def test_sequence_parallel_reason_states_the_padded_token_sharded_output(num_tokens, why, padding):
    """Where p does not divide T the notes state T', each rank's rows of it and where the padding starts; nothing
    is gathered."""
    decision = select_tier(dataclasses.replace(K3, sequence_parallel=True), num_tokens, 8)
    assert f"T={num_tokens} {why}" in decision.reason
    assert "padded with zero rows to T'=8: each rank returns its 1 of the [8, H] output" in decision.reason
    assert f"whose rows {padding} are padding" in decision.reason
    assert "gather" not in decision.reason and "replicated" not in decision.reason


@pytest.mark.parametrize("num_tokens", [1, 256, 257, 8192])
def test_one_shot_is_never_selected_without_a_cost_model(num_tokens):
    assert select_tier(K3, num_tokens, 8).tier != Tier.ONE_SHOT


PREFILL = dataclasses.replace(K3, sequence_parallel=True, prefill_token_parallel_min_tokens=1024)


@pytest.mark.parametrize(("num_tokens", "tier"), [(1023, Tier.COLUMN_PARALLEL), (1024, Tier.TOKEN_PARALLEL),
                                                  (8192, Tier.TOKEN_PARALLEL)])
def test_token_parallel_from_the_prefill_threshold_with_the_replicated_kernel(num_tokens, tier):
    decision = select_tier(PREFILL, num_tokens, 8, weight_layout="replicated")
    assert decision.tier == tier
    rule = f"sequence-parallel output and T={num_tokens} >= prefill_token_parallel_min_tokens=1024"
    assert decision.reason.startswith(rule) == (tier is Tier.TOKEN_PARALLEL)


@pytest.mark.parametrize(
    ("changes", "weight_layout", "why"),
    [
        ({"prefill_token_parallel_min_tokens": 0}, "replicated", None),
        ({"sequence_parallel": False}, "replicated", None),
        ({}, "column", "it needs weight_layout='replicated', got 'column'"),
        ({}, None, "it needs weight_layout='replicated', got None"),
    ],
    ids=["off", "replicated_output", "column_kernel", "layout_unknown"],
)
def test_token_parallel_rule_does_not_fire_and_says_why_when_only_the_layout_stops_it(changes, weight_layout, why):
    decision = select_tier(dataclasses.replace(PREFILL, **changes), 2048, 8, weight_layout=weight_layout)
    assert decision.tier == Tier.COLUMN_PARALLEL
    assert (why is not None) == ("not token_parallel" in decision.reason)
    if why:
        assert why in decision.reason


def test_preconditions_come_before_the_token_parallel_rule():
    assert select_tier(PREFILL, 2048, 1, weight_layout="replicated").tier == Tier.NATIVE


@pytest.mark.parametrize(("platform", "dtype", "note"), [("cpu", "bfloat16", True), ("cpu", "float32", False),
                                                         ("gpu", "bfloat16", False), (None, "bfloat16", False)])
def test_the_reason_says_where_all_reduces_run_as_reduce_scatter_and_all_gather(platform, dtype, note):
    decision = select_tier(dataclasses.replace(K3, dtype=dtype), 1024, 8, platform=platform)
    assert ("runs as reduce-scatter + all-gather" in decision.reason) == note


def test_a_fixed_all_reduce_form_is_named_in_the_reason():
    decision = select_tier(dataclasses.replace(K3, all_reduce_form="all-reduce"), 1024, 8, platform="cpu")
    assert decision.reason.endswith("; all_reduce_form='all-reduce'")


def test_the_rule_and_the_notes_are_apart_and_the_reason_joins_them():
    decision = select_tier(K3, 1024, 8, platform="cpu")
    assert decision.rule == "T=1024 > overlap_token_threshold=256"
    assert decision.notes[0] == gpu_rules_note(K3, "cpu")
    assert len(decision.notes) == 2 and "runs as reduce-scatter + all-gather" in decision.notes[1]
    assert decision.reason == f"{decision.rule}; {decision.notes[0]}; {decision.notes[1]}"


def test_no_all_reduce_form_note_where_no_buffer_reaches_its_size():
    """At T=16 the largest sum is 16 x 7168 bf16 (224 KiB), far below the 8 MiB from which cpu splits."""
    assert select_tier(K3, 16, 8, platform="cpu").notes == (gpu_rules_note(K3, "cpu"),)


@pytest.mark.parametrize("changes", [{}, {"all_reduce_form": "all-reduce"}], ids=["auto", "fixed"])
def test_no_all_reduce_form_note_on_one_rank(changes):
    """p = 1 sends nothing, so no note says how its sums travel."""
    assert select_tier(dataclasses.replace(K3, **changes), 4096, 1, platform="cpu").notes == ()


def test_no_quantisation_note_on_one_rank():
    assert select_tier(dataclasses.replace(K3, all_reduce_quantization="int4"), 4096, 1).notes == ()


def test_no_sequence_parallel_note_without_it():
    assert not any("sequence-parallel" in note for note in select_tier(K3, 5, 8).notes)


def test_the_vllm_rules_given_explicitly_are_the_default():
    config = dataclasses.replace(K3, selection_policy=VllmRules())
    assert [select_tier(config, t, 8) for t in (1, 300)] == [select_tier(K3, t, 8) for t in (1, 300)]


K3_TABLE = SelectionTable(device_kind="cpu", tp_size=8, weight_layout="column", hidden_size=K3.hidden_size,
                          latent_size=K3.latent_size, dtype=K3.dtype.name, ranges=(TokenRange(1, None, Tier.NATIVE),))


@pytest.mark.parametrize(("platform", "policy", "noted"), [
    ("cpu", None, True), ("cpu", VllmRules(), True), ("tpu", None, True),
    ("cuda", None, False), ("rocm", None, False), ("gpu", None, False), (None, None, False),
    ("cpu", K3_TABLE, False), ("cpu", CostModelPolicy("h200"), False),
], ids=["cpu", "cpu-vllm-rules", "tpu", "cuda", "rocm", "gpu", "platform-unknown", "cpu-table", "cpu-cost-model"])
def test_the_gpu_thresholds_note_only_where_vllms_rules_pick_for_a_platform_that_is_no_gpu(platform, policy, noted):
    config = dataclasses.replace(K3, selection_policy=policy)
    decision = select_tier(config, 16, 8, weight_layout="column", device_kind="cpu", platform=platform)
    assert any("vLLM's GPU thresholds" in note for note in decision.notes) == noted


def test_the_gpu_thresholds_note_is_one_line_naming_calibrate_and_the_table_it_writes():
    note = gpu_rules_note(K3, "cpu")
    assert "\n" not in note and "not measured on this cpu platform" in note
    assert "`python -m k3_tail calibrate --out table.json`" in note
    assert "TailConfig(selection_policy=SelectionTable.load('table.json'))" in note


@pytest.mark.parametrize(("num_tokens", "tp_size"), [(16, 1), (0, 8)], ids=["one-rank", "empty"])
def test_no_gpu_thresholds_note_where_a_precondition_picks_native(num_tokens, tp_size):
    """p = 1 and T = 0 take native under every policy: no threshold chose it."""
    assert not any("GPU thresholds" in note for note in select_tier(K3, num_tokens, tp_size, platform="cpu").notes)


# ---- The platform argument: JAX's names, the GPU vendors', or a device ----------------------------------------------

GPU_NAMES = ["cuda", "rocm", "gpu"]


def test_jaxs_gpu_platform_name_picks_one_kernel_at_decode_as_a_gpu_device_does():
    """JAX's Device.platform is "gpu" for CUDA and ROCm devices, whose calls run one_kernel at T = 1."""
    assert select_tier(K3, 1, 8, weight_layout="column", platform="gpu").tier is Tier.ONE_KERNEL


@pytest.mark.parametrize("policy", [None, CostModelPolicy("mi355x"), CostModelPolicy("h200")],
                         ids=["vllm-rules", "cost-model-mi355x", "cost-model-h200"])
@pytest.mark.parametrize("changes", [{}, {"shared_output_is_reduced": True}, {"all_reduce_quantization": "int4"},
                                     {"sequence_parallel": True, "prefill_token_parallel_min_tokens": 512}],
                         ids=["k3", "reduced-shared", "int4-sums", "token-parallel-prefill"])
@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
def test_gpu_selects_the_tier_and_notes_that_cuda_and_rocm_both_get(policy, changes, weight_layout):
    """Nothing selection decides depends on the GPU's vendor, so JAX's "gpu" needs no vendor to answer."""
    config = dataclasses.replace(K3, selection_policy=policy, **changes)
    for num_tokens in (1, 16, 64, 65, 256, 257, 1024, 8192):
        decisions = [select_tier(config, num_tokens, 8, weight_layout=weight_layout, platform=name)
                     for name in GPU_NAMES]
        assert len({(decision.tier, decision.notes) for decision in decisions}) == 1, (num_tokens, decisions)


def test_a_device_selects_as_the_platform_device_platform_names():
    device = jax.devices()[0]
    assert select_tier(K3, 16, 8, weight_layout="column", platform=device) == \
        select_tier(K3, 16, 8, weight_layout="column", platform=device_platform(device))


@pytest.mark.parametrize("platform", ["banana", "GPU", "Cuda", "", "hip", 3])
def test_an_unknown_platform_is_a_value_error_naming_platform_and_the_names_taken(platform):
    with pytest.raises(ValueError, match=r"^platform: expected one of \('cpu', 'gpu', 'tpu', 'cuda', 'rocm'\)"):
        select_tier(K3, 16, 8, platform=platform)


@pytest.mark.parametrize("policy", [VllmRules(), CostModelPolicy("mi300x"), K3_TABLE],
                         ids=["vllm-rules", "cost-model", "table"])
def test_every_policy_refuses_an_unknown_platform_when_asked_itself(policy):
    with pytest.raises(ValueError, match="^platform: "):
        policy.select(K3, 16, 8, weight_layout="column", device_kind="cpu", platform="banana")


@pytest.mark.parametrize("weight_layout", ["Replicated", "replicate", "cols", ""])
def test_a_weight_layout_that_is_none_of_the_layouts_is_refused_naming_it(weight_layout):
    with pytest.raises(ValueError, match=r"^weight_layout: expected one of \('column', 'replicated'\)"):
        select_tier(K3, 5, 8, weight_layout=weight_layout)


@pytest.mark.parametrize("device_kind", [3, "", b"NVIDIA H200"])
def test_a_device_kind_that_is_no_name_is_refused_naming_it(device_kind):
    with pytest.raises(ValueError, match="^device_kind: expected a device kind"):
        select_tier(K3, 5, 8, device_kind=device_kind)


def test_check_device_kind_takes_a_name_or_none():
    assert check_device_kind("NVIDIA H200") == "NVIDIA H200" and check_device_kind(None) is None
    with pytest.raises(ValueError, match=r"^kind: expected a device kind \(jax.Device.device_kind, a non-empty "
                                         r"string\) or None, got 3"):
        check_device_kind(3, "kind")
