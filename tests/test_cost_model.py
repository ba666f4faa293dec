"""k3_tail.selection.cost_model: per-rank counts that agree with the compiled programs, the time model, crossovers.

The agreement tests compile every tier with :func:`k3_tail.compile_tail` and read the result with
:func:`k3_tail.xla.report.report` and the program's HLO: on the deviceless 8 x H100 and 8 x MI300X
topologies (XLA's real CUDA and AMDGPU pipelines; the ``[aot]`` and ``[rocm-aot]`` extras, each skipped
where it cannot compile; 8 x MI355X is the full cross, ``slow``), where collectives move bf16 as the tiers
issue them, they compare bytes; on the 8-device CPU mesh, which moves bf16 collectives as float32, they
compare element counts.
"""

import dataclasses
import math
import re

import jax
import pytest

from helpers import (
    compiled_tail,
    gpu_mesh_for,
    make_tp_mesh,
    pairwise_params,
    tier_layouts,
    tier_supports_layout,
    topology_params,
)
from k3_tail import TailConfig, Tier
from k3_tail.selection.collective_cost import CollectiveCost
from k3_tail.selection.cost_model import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    HARDWARE,
    REDUCE_SCATTER,
    CostModelPolicy,
    Crossover,
    Hardware,
    TierCost,
    best_tier,
    crossovers,
    predict_time,
    tier_cost,
)
from k3_tail.selection.rules import VllmRules
from k3_tail.xla.compilation import tail_arguments
from k3_tail.xla.hlo_text import parse_module
from k3_tail.xla.report import report

K3 = TailConfig.kimi_k3()
L, H, P = K3.latent_size, K3.hidden_size, 8
KINDS = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL)
TOLERANCE = 0.05
# H not divisible by p (padded column blocks), and the switches that change what a tier moves.
VARIANTS = {
    "h1001": TailConfig(hidden_size=1001, latent_size=512),
    "no_shared": TailConfig.kimi_k3(has_shared_experts=False),
    "no_norm": TailConfig.kimi_k3(use_latent_norm=False),
    "fused_reduced": TailConfig.kimi_k3(routed_output_is_reduced=True),
    "fp8": TailConfig.kimi_k3(up_proj_dtype="float8_e4m3fn"),
    "shared_reduced": TailConfig.kimi_k3(shared_output_is_reduced=True),
}


@pytest.fixture(scope="module", params=topology_params("h100x8", "mi300xx8", "mi355xx8", slow=("mi355xx8",)))
def gpu_mesh(request):
    return gpu_mesh_for(request.param, P)


def compiled_figures(config, mesh, num_tokens, tier, weight_layout, *, elements=False):
    """Per-device figures of the compiled program, named as the model's (bytes, or elements on CPU)."""
    compiled = compiled_tail(config, mesh, num_tokens, tier, weight_layout)
    result = report(compiled)
    entry = parse_module(compiled.as_text()).entry
    arguments = tail_arguments(config, mesh, num_tokens, weight_layout=weight_layout)
    # An FP8 kernel is two arguments (values, scales): both count as the kernel.
    roles = [role for role, argument in zip(("routed", "shared", "norm", "kernel"), arguments, strict=True)
             for _ in jax.tree.leaves(argument)] + ["ranks"]  # compile_tail's last argument, the ranks' indices
    parameters = {}
    for instruction in entry.instructions:
        if instruction.opcode == "parameter":
            role = roles[int(instruction.operand_text)]
            parameters[role] = parameters.get(role, 0) + sum(a.bytes for a in instruction.arrays)
    kernel = parameters["kernel"]
    if tier in (Tier.COLUMN_PARALLEL, Tier.SCATTER_GATHER, Tier.ONE_KERNEL) and weight_layout == "replicated":
        kernel /= mesh.shape["tp"]  # these tiers read only their own [L, H/p] block of the whole kernel
    # one_kernel's tiles of 64 rows read the block once each (its GEMM's FLOPs are its own custom call's).
    kernel *= tier.record.weight_reads(num_tokens)
    root = next(i for i in entry.instructions if i.is_root)
    size = (lambda array: array.elements) if elements else (lambda array: array.bytes)
    figures = {
        "gemm_flops": result.gemm_flops,
        "weight_bytes": kernel + parameters.get("norm", 0),
        "activation_bytes": parameters["routed"] + parameters.get("shared", 0) + sum(a.bytes for a in root.arrays),
    }
    for kind in KINDS:
        figures[kind] = sum(size(array) for c in result.of_kind(kind) for array in c.arrays)
    return figures


def model_figures(config, num_tokens, tier, weight_layout, *, elements=False):
    cost = tier_cost(config, num_tokens, P, tier=tier, weight_layout=weight_layout)
    scale = config.dtype.itemsize if elements else 1
    figures = {"gemm_flops": cost.gemm_flops, "weight_bytes": cost.weight_bytes,
               "activation_bytes": cost.activation_bytes}
    for kind in KINDS:
        figures[kind] = cost.collective_bytes(kind) // scale
    return figures


def assert_agree(model, compiled):
    """Every figure within TOLERANCE of the compiled program's (both zero counts as agreement)."""
    off = {name: (model[name], compiled[name]) for name in model
           if not math.isclose(model[name], compiled[name], rel_tol=TOLERANCE)}
    assert not off, f"model vs compiled beyond {TOLERANCE:.0%}: {off}"


def agreement_case_id(values):
    num_tokens, tier, weight_layout, sequence_parallel = values
    return f"{num_tokens}-{tier.value}-{weight_layout}-{'token_sharded' if sequence_parallel else 'replicated'}_output"


# Every pair of T (one row, decode, the overlap threshold), tier, layout and output form (replicated, or token-sharded:
# sequence-parallel, its rows padded to a multiple of p at T = 1); the whole product with ``pytest -m slow``.
AGREEMENT_FACTORS = {"num_tokens": (1, 16, 256), "tier": tuple(Tier), "weight_layout": ("column", "replicated"),
                     "sequence_parallel": (False, True)}
AGREEMENT_CASES = pairwise_params(AGREEMENT_FACTORS, agreement_case_id, tier_supports_layout)


@pytest.mark.parametrize("num_tokens, tier, weight_layout, sequence_parallel", AGREEMENT_CASES)
def test_counts_agree_with_the_gpu_compiled_program(gpu_mesh, num_tokens, tier, weight_layout, sequence_parallel):
    """GEMM FLOPs, weight, activation and collective bytes per kind (XLA may combine all-reduces)."""
    config = TailConfig.kimi_k3(sequence_parallel=sequence_parallel)
    assert_agree(model_figures(config, num_tokens, tier, weight_layout),
                 compiled_figures(config, gpu_mesh, num_tokens, tier, weight_layout))


# Where a config switch changes what a tier moves or reads (T = 16): padded column blocks (H = 1001, p = 8),
# no shared reduction, no x in one_shot's packed buffer, no latent all-reduce, an FP8 kernel, a shared output
# reduced before the tail (the tiers whose collectives change shape, and native, which only loses one).
# Overlap's padded column collectives are native's (the same three, one hidden): it runs with ``pytest -m slow``.
VARIANT_CASES = [
    *(pytest.param("h1001", tier, layout, id=f"h1001-{tier.value}-{layout}",
                   marks=pytest.mark.slow if tier is Tier.OVERLAP else ())
      for tier in Tier for layout in ("column", "replicated") if tier.supports(layout)
      and (layout == "column" or tier is Tier.ONE_SHOT)),
    *(pytest.param("no_shared", tier, "replicated", id=f"no_shared-{tier.value}")
      for tier in (Tier.OVERLAP, Tier.SCATTER_GATHER, Tier.ONE_SHOT)),
    pytest.param("no_norm", Tier.ONE_SHOT, "replicated", id="no_norm-one_shot"),
    pytest.param("fused_reduced", Tier.COLUMN_PARALLEL, "column", id="fused_reduced-column_parallel"),
    *(pytest.param("shared_reduced", tier, "column" if tier.supports("column") else "replicated",
                   id=f"shared_reduced-{tier.value}")
      for tier in (Tier.NATIVE, Tier.COLUMN_PARALLEL, Tier.ONE_SHOT, Tier.TOKEN_PARALLEL)),
    # FP8 kernel bytes (values and scales) on the whole kernel, a column block and a sliced block.
    *(pytest.param("fp8", tier, layout, id=f"fp8-{tier.value}-{layout}")
      for tier, layout in ((Tier.OVERLAP, "replicated"), (Tier.SCATTER_GATHER, "column"),
                           (Tier.COLUMN_PARALLEL, "replicated"))),
]


@pytest.mark.parametrize("variant, tier, weight_layout", VARIANT_CASES)
def test_counts_agree_for_config_variants(gpu_mesh, variant, tier, weight_layout):
    config = VARIANTS[variant]
    assert_agree(model_figures(config, 16, tier, weight_layout),
                 compiled_figures(config, gpu_mesh, 16, tier, weight_layout))


# The agreement design pairs T = 1 with the token-sharded output (every pair of values is in it): padded rows, as here,
# which repeats it with ``pytest -m slow``.
@pytest.mark.slow
@pytest.mark.parametrize("tier", [Tier.NATIVE, Tier.SCATTER_GATHER])
def test_padded_sequence_parallel_call_agrees_with_the_gpu_compiled_program(gpu_mesh, tier):
    """p does not divide T = 5: the tier runs on 8 rows and each rank returns its one row of them (tail_forward)."""
    config = TailConfig.kimi_k3(sequence_parallel=True)
    assert_agree(model_figures(config, 5, tier, "replicated"),
                 compiled_figures(config, gpu_mesh, 5, tier, "replicated"))


# On a CPU one_kernel's Pallas kernel runs interpreted, for every rank on every rank's gathered inputs
# (k3_tail.ops.fused_projection): that program is no GPU's.
CPU_PROGRAM_TIERS = [param for param in tier_layouts() if param.values[0] is not Tier.ONE_KERNEL]


@pytest.mark.parametrize("tier, weight_layout", CPU_PROGRAM_TIERS)
def test_element_counts_agree_with_the_cpu_compiled_program(tier, weight_layout):
    """On CPU collectives move float32, so collectives compare as elements (the rest as bytes)."""
    model = model_figures(K3, 16, tier, weight_layout, elements=True)
    compiled = compiled_figures(K3, make_tp_mesh(P), 16, tier, weight_layout, elements=True)
    assert_agree(model, compiled)


# The module docstring's table at Kimi-K3, T = 16, p = 8: (kind, elements, hidden) per collective.
T16 = 16
HB = H // P
EXPECTED_COLLECTIVES = {
    (Tier.NATIVE, "replicated"): [(ALL_REDUCE, T16 * L, False), (ALL_REDUCE, T16 * H, False)],
    (Tier.NATIVE, "column"): [(ALL_REDUCE, T16 * L, False), (ALL_GATHER, T16 * H, False), (ALL_REDUCE, T16 * H, False)],
    (Tier.OVERLAP, "replicated"): [(ALL_REDUCE, T16 * L, False), (ALL_REDUCE, T16 * H, True)],
    (Tier.OVERLAP, "column"): [(ALL_REDUCE, T16 * L, False), (ALL_REDUCE, T16 * H, True), (ALL_GATHER, T16 * H, False)],
    (Tier.COLUMN_PARALLEL, "replicated"): [(ALL_REDUCE, T16 * L, False), (ALL_REDUCE, T16 * H, False)],
    (Tier.COLUMN_PARALLEL, "column"): [(ALL_REDUCE, T16 * L, False), (ALL_REDUCE, T16 * H, False)],
    (Tier.SCATTER_GATHER, "replicated"): [(ALL_REDUCE, T16 * L, False), (REDUCE_SCATTER, T16 * H, True),
                                          (ALL_GATHER, T16 * H, False)],
    (Tier.SCATTER_GATHER, "column"): [(ALL_REDUCE, T16 * L, False), (REDUCE_SCATTER, T16 * H, True),
                                      (ALL_GATHER, T16 * H, False)],
    (Tier.ONE_SHOT, "replicated"): [(ALL_REDUCE, T16 * (2 * H + L), False)],
    (Tier.TOKEN_PARALLEL, "replicated"): [(REDUCE_SCATTER, T16 * L, False), (REDUCE_SCATTER, T16 * H, False),
                                          (ALL_GATHER, T16 * H, False)],
    (Tier.ONE_KERNEL, "replicated"): [(ALL_REDUCE, T16 * L, False), (ALL_REDUCE, T16 * H, False)],
    (Tier.ONE_KERNEL, "column"): [(ALL_REDUCE, T16 * L, False), (ALL_REDUCE, T16 * H, False)],
}


@pytest.mark.parametrize("tier, weight_layout", tier_layouts())
def test_collectives_follow_the_table(tier, weight_layout):
    cost = tier_cost(K3, T16, P, tier=tier, weight_layout=weight_layout)
    assert [(c.kind, c.buffer_bytes // 2, c.hidden) for c in cost.collectives] == \
        EXPECTED_COLLECTIVES[tier, weight_layout]
    assert all(c.group_size == P for c in cost.collectives)


@pytest.mark.parametrize("tier, weight_layout", tier_layouts())
def test_gemm_is_all_columns_only_with_the_replicated_kernel_and_own_rows_only_for_token_parallel(tier, weight_layout):
    cost = tier_cost(K3, T16, P, tier=tier, weight_layout=weight_layout)
    full_width = (Tier.NATIVE, Tier.OVERLAP, Tier.ONE_SHOT, Tier.TOKEN_PARALLEL)
    columns = H if weight_layout == "replicated" and tier in full_width else HB
    rows = T16 // P if tier is Tier.TOKEN_PARALLEL else T16
    assert cost.gemm_flops == 2 * rows * L * columns
    assert cost.weight_bytes == 2 * (L * columns + L)
    assert cost.activation_bytes == 2 * T16 * (L + 2 * H)


@pytest.mark.parametrize("kind, factor", [(ALL_REDUCE, 2 * 7 / 8), (REDUCE_SCATTER, 7 / 8), (ALL_GATHER, 7 / 8),
                                          (ALL_TO_ALL, 7 / 8)])
def test_ring_wire_bytes(kind, factor):
    assert CollectiveCost(kind, 1024, 8).wire_bytes == pytest.approx(factor * 1024)


def test_sequence_parallel_output_reduce_scatters_and_writes_own_rows():
    cost = tier_cost(TailConfig.kimi_k3(sequence_parallel=True), T16, P, tier=Tier.COLUMN_PARALLEL)
    assert [(c.kind, c.buffer_bytes // 2) for c in cost.collectives] == [(ALL_REDUCE, T16 * L),
                                                                         (REDUCE_SCATTER, T16 * H)]
    assert cost.activation_bytes == 2 * T16 * (L + H + H // P)


def test_sequence_parallel_with_p_not_dividing_t_runs_padded_rows_and_keeps_them_sharded():
    config = TailConfig.kimi_k3(sequence_parallel=True)
    padded = tier_cost(config, 5, P, tier=Tier.OVERLAP)
    exact = tier_cost(config, 8, P, tier=Tier.OVERLAP)
    assert padded.collectives == exact.collectives  # no all-gather: the 8 padded rows stay token-sharded
    assert padded.gemm_flops == exact.gemm_flops
    # The caller's 5 rows in, this rank's 8/8 = 1 row of the padded y out.
    assert padded.activation_bytes == 2 * (5 * L + 5 * H + 1 * H)


@pytest.mark.parametrize("tier", list(Tier))
def test_empty_batch_costs_nothing(tier):
    cost = tier_cost(K3, 0, P, tier=tier)
    assert (cost.gemm_flops, cost.weight_bytes, cost.activation_bytes, cost.collectives) == (0, 0, 0, ())
    assert predict_time(cost, "mi355x").total_s == 0


def test_time_is_the_roofline_plus_serial_collectives_with_the_hidden_one_overlapped():
    hardware = Hardware("unit", peak_flops=1e12, hbm_bytes_per_s=1e9, link_bytes_per_s=1e6, collective_latency_s=1.0)
    cost = TierCost(Tier.OVERLAP, 1, 4, "replicated", gemm_flops=3e12, weight_bytes=1e9, activation_bytes=1e9,
                    collectives=(CollectiveCost(ALL_REDUCE, 4e6, 4), CollectiveCost(ALL_REDUCE, 1e6, 4, hidden=True)))
    # compute 3 s, memory 2 s; serial AR 1 + 1.5 * 4 = 7 s; hidden AR 1 + 1.5 * 1 = 2.5 s, inside the 3 s local work
    prediction = predict_time(cost, hardware)
    assert dataclasses.astuple(prediction) == pytest.approx((3.0, 2.0, 9.5, 10.0, 0.0))
    assert prediction.local_s == 3.0


def test_collectives_of_one_rank_cost_nothing():
    cost = tier_cost(K3, 16, 1, tier=Tier.NATIVE)
    prediction = predict_time(cost, "h200")
    assert cost.collectives and prediction.collective_s == 0
    assert prediction.total_s == pytest.approx(prediction.local_s + prediction.launch_s)


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_overlap_is_never_slower_than_native(num_tokens, weight_layout, hardware):
    native, overlap = (predict_time(tier_cost(K3, num_tokens, P, tier=tier, weight_layout=weight_layout),
                                    hardware).total_s for tier in (Tier.NATIVE, Tier.OVERLAP))
    assert overlap <= native


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
@pytest.mark.parametrize("tier, weight_layout", tier_layouts())
def test_predicted_time_grows_with_the_token_count(tier, weight_layout, hardware):
    """From two tokens on: a one-token call may launch more kernels (the pad to two rows, the norm's two
    reductions, the slice back), which the model charges."""
    times = [predict_time(tier_cost(K3, t, P, tier=tier, weight_layout=weight_layout), hardware).total_s
             for t in (2, 16, 256, 4096)]
    assert times == sorted(times)


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
@pytest.mark.parametrize("tier, weight_layout", tier_layouts())
def test_a_call_pays_its_kernels(tier, weight_layout, hardware):
    """Each kernel of the record's count on the preset's platform costs kernel_launch_s, serially."""
    cost = tier_cost(K3, 16, P, tier=tier, weight_layout=weight_layout)
    preset = HARDWARE[hardware]
    prediction = predict_time(cost, preset)
    kernels = tier.record.gpu_kernels.of(preset.platform, weight_layout, 16)
    assert cost.gpu_kernels[preset.platform] == kernels
    assert prediction.launch_s == pytest.approx(kernels * preset.kernel_launch_s)
    without = predict_time(cost, dataclasses.replace(preset, kernel_launch_s=0.0))
    assert prediction.total_s == pytest.approx(without.total_s + prediction.launch_s)


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_one_shot_wins_only_through_the_latency_it_saves(hardware):
    """It moves more bytes than overlap for the same local work: with no latency it never wins."""
    no_latency = dataclasses.replace(HARDWARE[hardware], collective_latency_s=0.0)
    assert all(c.after is not Tier.ONE_SHOT for c in crossovers(K3, P, hardware=no_latency))
    assert best_tier(K3, 1, P, hardware=no_latency).tier is not Tier.ONE_SHOT


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_replicated_layout_one_kernel_then_overlap(hardware):
    """What the model implies for Kimi-K3 at TP8: one kernel wins decode, the hidden AR the batches after (near
    the crossover the kernel's scratch, which steps with its split of K, may hand a few counts back)."""
    changes = crossovers(K3, P, hardware=hardware, weight_layout="replicated", token_range=(1, 1024))
    assert {(c.before, c.after) for c in changes} <= {(Tier.ONE_KERNEL, Tier.OVERLAP), (Tier.OVERLAP, Tier.ONE_KERNEL)}
    assert changes[0].before is Tier.ONE_KERNEL and changes[-1].after is Tier.OVERLAP
    assert K3.one_kernel_max_tokens < changes[0].num_tokens and changes[-1].num_tokens <= 512


@pytest.mark.parametrize("hardware", ["mi300x", "mi325x", "mi355x"])
def test_replicated_layout_on_amd_without_one_kernel_one_shot_then_overlap(hardware):
    """Among the XLA tiers one collective wins small batches, the hidden AR the rest."""
    tiers = [tier for tier in Tier if tier is not Tier.ONE_KERNEL and tier.supports("replicated")]
    changes = crossovers(K3, P, hardware=hardware, weight_layout="replicated", token_range=(1, 1024), tiers=tiers)
    assert [(c.before, c.after) for c in changes] == [(Tier.ONE_SHOT, Tier.OVERLAP)]
    assert 1 < changes[0].num_tokens <= 256


@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
@pytest.mark.parametrize("tp_size", [4, 8, 16])
@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_one_kernel_max_tokens_is_inside_what_the_model_predicts_one_kernel_wins(hardware, tp_size, weight_layout):
    """vLLM's rules pick one_kernel on GPUs up to one_kernel_max_tokens (16): the model predicts it fastest at
    least that far, on every preset, TP size and layout."""
    for num_tokens in (1, 16, K3.one_kernel_max_tokens):
        decision = best_tier(K3, num_tokens, tp_size, hardware=hardware, weight_layout=weight_layout)
        assert decision.tier is Tier.ONE_KERNEL, decision.rule


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_token_parallel_wins_prefill_with_token_sharded_output(hardware):
    """Two reduce-scatters and no all-reduce: the fewest bytes once T is large (replicated kernel)."""
    config = TailConfig.kimi_k3(sequence_parallel=True)
    assert best_tier(config, 8192, P, hardware=hardware, weight_layout="replicated").tier is Tier.TOKEN_PARALLEL


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_column_layout_one_kernel_then_column_parallel_then_scatter_gather(hardware):
    """Decode: one kernel; then two collectives beat three (near that crossover the kernel's grid, whose fill
    steps with its row tiles and split of K, may hand a few counts back); many tokens: the reduce-scatter hidden
    behind the GEMM wins."""
    changes = crossovers(K3, P, hardware=hardware, weight_layout="column")
    *one_kernel, last = changes
    assert {(c.before, c.after) for c in one_kernel} <= {(Tier.ONE_KERNEL, Tier.COLUMN_PARALLEL),
                                                         (Tier.COLUMN_PARALLEL, Tier.ONE_KERNEL)}
    assert one_kernel[0].before is Tier.ONE_KERNEL and one_kernel[-1].after is Tier.COLUMN_PARALLEL
    assert (last.before, last.after) == (Tier.COLUMN_PARALLEL, Tier.SCATTER_GATHER)
    assert K3.one_kernel_max_tokens < one_kernel[0].num_tokens and one_kernel[-1].num_tokens <= 512
    assert last.num_tokens > 256


def scan_case_id(values):
    hardware, weight_layout, sequence_parallel, quantization = values
    return "-".join((hardware, weight_layout, "sp" if sequence_parallel else "nosp", quantization or "bf16"))


# Every pair of the GPU, layout and output form (the whole product with ``pytest -m slow``), quantised sums of either
# codec, and MI300X's column layout.
SCAN_CASES = [
    *pairwise_params({"hardware": ("mi355x", "h200"), "weight_layout": ("column", "replicated"),
                      "sequence_parallel": (False, True), "quantization": (None,)}, scan_case_id),
    *(pytest.param(*values, id=scan_case_id(values)) for values in (
        ("mi355x", "replicated", False, "int4"), ("h200", "column", True, "int8"), ("mi300x", "column", False, None))),
]


@pytest.mark.parametrize(("hardware", "weight_layout", "sequence_parallel", "quantization"), SCAN_CASES)
def test_crossovers_are_where_best_tier_changes(hardware, weight_layout, sequence_parallel, quantization):
    """The vectorised scan agrees with best_tier at every T of the range (with quantised sums too, whose
    default size window makes each sum's time piecewise in T, and on MI300X's column layout, where one_kernel's
    grid hands a few counts back)."""
    config = TailConfig.kimi_k3(sequence_parallel=sequence_parallel, all_reduce_quantization=quantization)
    kwargs = {"hardware": hardware, "weight_layout": weight_layout}
    fastest = [best_tier(config, t, P, **kwargs).tier for t in range(1, 2049)]
    pairs = zip(range(2, 2049), fastest, fastest[1:], strict=False)
    expected = [Crossover(t, before, after) for t, before, after in pairs if before is not after]
    assert list(crossovers(config, P, token_range=(1, 2048), **kwargs)) == expected


def test_crossovers_within_the_given_tiers():
    changes = crossovers(K3, P, hardware="mi355x", tiers=["native", Tier.COLUMN_PARALLEL])
    assert {c.before for c in changes} | {c.after for c in changes} <= {Tier.NATIVE, Tier.COLUMN_PARALLEL}


def test_best_tier_reason_quotes_every_candidate_fastest_first():
    decision = best_tier(K3, 1, P, hardware="mi355x")
    assert decision.tier is Tier.ONE_KERNEL
    assert decision.reason.startswith("predicted fastest on mi355x at T=1, p=8, replicated weights: one_kernel ")
    assert all(tier.value in decision.reason for tier in Tier)


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_presets_are_positive_and_named_by_their_key(name):
    hardware = HARDWARE[name]
    assert hardware.name == name
    assert min(hardware.peak_flops, hardware.hbm_bytes_per_s, hardware.link_bytes_per_s,
               hardware.collective_latency_s) > 0


def test_presets_cover_the_served_gpus():
    assert set(HARDWARE) == {"mi300x", "mi325x", "mi355x", "h200"}


BAD_ARGUMENTS = {
    "config": lambda: tier_cost("k3", 16, P, tier=Tier.NATIVE),
    "num_tokens-negative": lambda: tier_cost(K3, -1, P, tier=Tier.NATIVE),
    "num_tokens-bool": lambda: tier_cost(K3, True, P, tier=Tier.NATIVE),
    "tp_size": lambda: tier_cost(K3, 16, 0, tier=Tier.NATIVE),
    "tier": lambda: tier_cost(K3, 16, P, tier="fast"),
    "weight_layout": lambda: tier_cost(K3, 16, P, tier=Tier.NATIVE, weight_layout="row"),
    "tier-one_shot_column": lambda: tier_cost(K3, 16, P, tier=Tier.ONE_SHOT, weight_layout="column"),
    "tier-one_shot_fused_reduced": lambda: tier_cost(VARIANTS["fused_reduced"], 16, P, tier=Tier.ONE_SHOT),
    "cost": lambda: predict_time("cost", "h200"),
    "hardware-unknown": lambda: predict_time(tier_cost(K3, 16, P, tier=Tier.NATIVE), "b200"),
    "hardware-none": lambda: best_tier(K3, 16, P, hardware=None),
    "tiers-empty": lambda: best_tier(K3, 16, P, hardware="h200", tiers=[]),
    "tiers-string": lambda: best_tier(K3, 16, P, hardware="h200", tiers="native"),
    "tiers-unknown": lambda: best_tier(K3, 16, P, hardware="h200", tiers=["fast"]),
    "tiers-one_shot_column": lambda: best_tier(K3, 16, P, hardware="h200", weight_layout="column", tiers=["one_shot"]),
    "token_range-zero": lambda: crossovers(K3, P, hardware="h200", token_range=(0, 16)),
    "token_range-reversed": lambda: crossovers(K3, P, hardware="h200", token_range=(16, 1)),
    "token_range-list": lambda: crossovers(K3, P, hardware="h200", token_range=[1, 16]),
    "tp_size-crossovers": lambda: crossovers(K3, 0, hardware="h200"),
    "kind": lambda: CollectiveCost("all_reduce", 1024, P),
    "kind-collective_bytes": lambda: tier_cost(K3, 16, P, tier=Tier.NATIVE).collective_bytes("allreduce"),
    "group_size": lambda: CollectiveCost(ALL_REDUCE, 1024, 0),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_are_value_errors_naming_the_argument(case):
    with pytest.raises(ValueError, match=f"^{case.split('-')[0]}:"):
        BAD_ARGUMENTS[case]()


@pytest.mark.parametrize(
    "field, value",
    [("name", ""), ("peak_flops", 0), ("hbm_bytes_per_s", -1.0), ("link_bytes_per_s", math.inf),
     ("collective_latency_s", -1e-6), ("peak_flops", True), ("collective_latency_s", math.nan),
     ("peak_fp8_flops", 0), ("fp8_formats", ()), ("fp8_formats", "float8_e4m3fn"),
     ("platform", "gpu")],  # a preset's kernel counts are its vendor's: JAX's "gpu" names none
)
def test_bad_hardware_fields_are_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        dataclasses.replace(HARDWARE["h200"], **{field: value})


# --- one_kernel's grid, and the default rules ------------------------------------------------------------------


def test_one_kernel_runs_at_the_share_of_the_gpu_its_grid_fills():
    """Its grid (fused_grid) reaches TARGET_PROGRAMS at decode; at T = 64 on 8 ranks the cap on its split of K
    leaves 784 programs, and its local work runs at 784/1024 of both peaks. XLA's kernels fill the GPU."""
    decode, batch = (tier_cost(K3, t, P, tier=Tier.ONE_KERNEL, weight_layout="column") for t in (16, 64))
    assert (decode.grid_programs, decode.grid_fill) == (1568, 1.0)
    assert (batch.grid_programs, batch.grid_fill) == (784, 784 / 1024)
    filled = predict_time(dataclasses.replace(batch, grid_programs=None), "mi300x")
    unfilled = predict_time(batch, "mi300x")
    assert (unfilled.compute_s, unfilled.memory_s) == pytest.approx((filled.compute_s * 1024 / 784,
                                                                      filled.memory_s * 1024 / 784))
    xla = [tier_cost(K3, 64, P, tier=tier, weight_layout="column") for tier in Tier
           if tier is not Tier.ONE_KERNEL and tier.supports("column")]
    assert all(cost.grid_programs is None and cost.grid_fill == 1 for cost in xla)


def test_an_unfilled_grid_ends_one_kernel_sooner():
    """At T = 256 on MI300X (p = 8, column layout) one_kernel's grid is 672 programs: at that share column_parallel
    is predicted faster, where a full grid would have kept one_kernel ahead."""
    one_kernel, column = (tier_cost(K3, 256, P, tier=tier, weight_layout="column")
                          for tier in (Tier.ONE_KERNEL, Tier.COLUMN_PARALLEL))
    assert one_kernel.grid_programs == 672
    seconds = {name: predict_time(cost, "mi300x").total_s for name, cost in
               (("unfilled", one_kernel), ("filled", dataclasses.replace(one_kernel, grid_programs=None)),
                ("column", column))}
    assert seconds["filled"] < seconds["column"] < seconds["unfilled"]


def test_the_reason_names_a_grid_that_does_not_fill_the_gpu():
    assert "one_kernel" in best_tier(K3, 16, P, hardware="mi355x", weight_layout="column").rule
    assert "programs" not in best_tier(K3, 16, P, hardware="mi355x", weight_layout="column").rule
    assert "(its grid 784 of 1024 programs)" in best_tier(K3, 64, P, hardware="mi355x", weight_layout="column").rule


# Each preset on its own platform, Kimi-K3 at p = 8 with the column layout, decode to prefill.
PRESET_PLATFORMS = {"mi300x": "rocm", "mi355x": "rocm", "h200": "cuda"}
RULES_SWEEP = (1, 2, 4, 8, 16, 17, 32, 48, 64, 65, 128, 256, 257, 512, 1024, 2048, 4096, 8192)


@pytest.mark.parametrize("hardware", sorted(PRESET_PLATFORMS))
def test_the_cost_model_agrees_with_the_default_rules_or_says_why_not(hardware):
    """Both pick one_kernel at decode (T <= one_kernel_max_tokens). Where the tiers differ, the cost model's
    reason names the rules' tier and the rule that picks it, after the predicted times of both; where it keeps
    one_kernel past one_kernel_max_tokens, it says that the rules stop one_kernel there."""
    platform = PRESET_PLATFORMS[hardware]
    for num_tokens in RULES_SWEEP:
        model = CostModelPolicy(hardware).select(K3, num_tokens, P, weight_layout="column", platform=platform)
        rules = VllmRules().select(K3, num_tokens, P, weight_layout="column", platform=platform)
        if num_tokens <= K3.one_kernel_max_tokens:
            assert model.tier is rules.tier is Tier.ONE_KERNEL, model.rule
        if model.tier is rules.tier:
            assert "default rules" not in model.rule
            continue
        predicted, why = model.rule.split("; unlike the default rules, which ")
        assert re.search(rf" {rules.tier.value} \d+\.\d\d us", predicted) and f" {model.tier.value} " in predicted
        stop = f"stop one_kernel at one_kernel_max_tokens={K3.one_kernel_max_tokens} and " \
            if model.tier is Tier.ONE_KERNEL else ""
        assert why == f"{stop}pick {rules.tier.value} ({rules.rule})"


# --- FP8 up-projection weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("tier, weight_layout", tier_layouts())
def test_fp8_weights_read_one_byte_per_kernel_element_plus_a_float32_scale_per_column(tier, weight_layout):
    bf16 = tier_cost(K3, 16, P, tier=tier, weight_layout=weight_layout)
    fp8 = tier_cost(TailConfig.kimi_k3(up_proj_dtype="float8_e4m3fnuz"), 16, P, tier=tier, weight_layout=weight_layout)
    columns = tier.record.gemm_columns(H, P, weight_layout)
    assert bf16.weight_bytes - fp8.weight_bytes == L * columns - 4 * columns
    assert dataclasses.replace(fp8, weight_bytes=bf16.weight_bytes) == bf16


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_fp8_activations_run_the_gemm_at_the_fp8_peak_only_in_a_format_the_gpu_multiplies(hardware):
    preset = HARDWARE[hardware]
    for name in ("float8_e4m3fn", "float8_e4m3fnuz"):
        config = TailConfig.kimi_k3(up_proj_dtype=name, fp8_activations=True)
        cost = tier_cost(config, 4096, P, tier=Tier.NATIVE)
        peak = preset.peak_fp8_flops if name in preset.fp8_formats else preset.peak_flops
        assert predict_time(cost, preset).compute_s == pytest.approx(cost.gemm_flops / peak)


def test_weight_only_fp8_saves_bytes_not_flop_time():
    bf16, fp8 = (tier_cost(TailConfig.kimi_k3(up_proj_dtype=d), 1, P, tier=Tier.OVERLAP)
                 for d in (None, "float8_e4m3fn"))
    bf16_time, fp8_time = (predict_time(cost, "mi355x") for cost in (bf16, fp8))
    assert fp8_time.compute_s == bf16_time.compute_s and fp8_time.memory_s < 0.51 * bf16_time.memory_s


def test_presets_double_the_dense_peak_for_fp8_in_their_native_formats():
    assert {name: preset.fp8_formats for name, preset in HARDWARE.items()} == {
        "mi300x": ("float8_e4m3fnuz",), "mi325x": ("float8_e4m3fnuz",), "mi355x": ("float8_e4m3fn",),
        "h200": ("float8_e4m3fn",),
    }
    for preset in HARDWARE.values():
        assert preset.peak_fp8_flops / preset.peak_flops == pytest.approx(2.0, rel=0.001)


@pytest.mark.parametrize("weight_layout", ["replicated", "column"])
def test_fp8_weights_move_the_crossovers_later_on_mi355x(weight_layout):
    """Halving the kernel bytes cheapens the weight-bound local work, so the tier that saves collective
    latency (one_shot; column_parallel on the column layout) keeps winning to larger T."""
    bf16, fp8 = (crossovers(TailConfig.kimi_k3(up_proj_dtype=d), P, hardware="mi355x", weight_layout=weight_layout)
                 for d in (None, "float8_e4m3fn"))
    assert (fp8[0].before, fp8[0].after) == (bf16[0].before, bf16[0].after)
    assert fp8[0].num_tokens > bf16[0].num_tokens


# --- Quantised sums ---------------------------------------------------------------------------------------------


# Native's quantised sums on the replicated kernel are column_parallel's on the column layout (the latent's and the
# shared output's all-reduces, nothing else): it runs with ``pytest -m slow``.
@pytest.mark.parametrize("tier, weight_layout", [
    pytest.param(Tier.NATIVE, "replicated", marks=pytest.mark.slow), (Tier.OVERLAP, "column"),
    (Tier.COLUMN_PARALLEL, "column"), (Tier.SCATTER_GATHER, "replicated"), (Tier.ONE_SHOT, "replicated"),
    (Tier.TOKEN_PARALLEL, "replicated"),
])
def test_quantised_wire_bytes_agree_with_the_gpu_compiled_program(gpu_mesh, tier, weight_layout):
    """Every sum int4-quantised (T = 256): the model's encoded wire bytes are the program's all-to-alls
    and all-gathers (and the plain collectives it keeps, e.g. the column layout's output gather)."""
    config = TailConfig.kimi_k3(all_reduce_quantization="int4", quantized_all_reduce_min_bytes=0)
    cost = tier_cost(config, 256, P, tier=tier, weight_layout=weight_layout)
    compiled = report(compiled_tail(config, gpu_mesh, 256, tier, weight_layout))
    assert any(c.codec for c in cost.collectives) and any(c.quantization for c in compiled.collectives)
    assert sum(c.wire_bytes for c in cost.collectives) == pytest.approx(
        sum(c.wire_bytes for c in compiled.collectives), rel=1e-4)


def test_a_quantised_all_reduce_costs_two_latencies_its_encoded_bytes_and_three_codec_passes():
    hardware = Hardware("unit", peak_flops=1e12, hbm_bytes_per_s=1e9, link_bytes_per_s=1e6, collective_latency_s=1.0)
    # 4 ranks, 8192 bf16 elements: chunks of 2048 = 64 blocks of 18 bytes (int4): payload 4 * 1152 bytes.
    collective = CollectiveCost(ALL_REDUCE, 16384, 4, codec="int4")
    assert collective.payload_bytes == 4608
    assert collective.wire_bytes == pytest.approx(1.5 * 4608)
    passes = 2 * 16384 + 3 * 4608 + 4608 / 4
    assert collective.seconds(hardware) == pytest.approx(2.0 + 1.5 * 4608 / 1e6 + passes / 1e9)
    scatter = CollectiveCost(REDUCE_SCATTER, 16384, 4, codec="int4")
    assert scatter.seconds(hardware) == pytest.approx(1.0 + 0.75 * 4608 / 1e6 + (16384 * 1.25 + 2 * 4608) / 1e9)


def test_tier_cost_quantises_exactly_the_sums_inside_the_window():
    """Kimi-K3 at T = 256 on 8 ranks with int4 (vLLM minimum 2 MiB): the 3.7 MB shared sum is quantised,
    the 1.8 MB latent sum is not, and an all-gather never is."""
    config = TailConfig.kimi_k3(all_reduce_quantization="int4")
    cost = tier_cost(config, 256, P, tier=Tier.OVERLAP, weight_layout="column")
    assert [(c.kind, c.codec) for c in cost.collectives] == [
        (ALL_REDUCE, None), (ALL_REDUCE, "int4"), (ALL_GATHER, None)]


@pytest.mark.parametrize(("kind", "codec"), [(ALL_GATHER, "int4"), (ALL_REDUCE, "int5")])
def test_a_codec_only_on_a_sum_and_only_a_known_one(kind, codec):
    with pytest.raises(ValueError, match="codec"):
        CollectiveCost(kind, 1024, 8, codec=codec)


def test_quantisation_speeds_up_prefill_on_mi355x_by_its_wire_bytes():
    """At T = 8192 on MI355X the sums are mostly wire time: int4 saves time over bf16."""
    plain = predict_time(tier_cost(K3, 8192, P, tier=Tier.COLUMN_PARALLEL, weight_layout="column"), "mi355x")
    config = TailConfig.kimi_k3(all_reduce_quantization="int4")
    quantised = predict_time(tier_cost(config, 8192, P, tier=Tier.COLUMN_PARALLEL, weight_layout="column"), "mi355x")
    assert quantised.collective_s < 0.5 * plain.collective_s
