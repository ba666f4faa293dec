"""What the tail's tiers are worth inside the Kimi-K3 latent MoE layer (k3_tail/models/kimi_k3/layer.py).

    python scripts/kimi_k3_layer_share.py [--parts cpu,h100,early,cost,model] [--tokens 1,4,16,64,256,1024]
        [--repeats 3] [--compile-tokens 1,16,256] [--cost-tokens 1,16,256,2048,8192]
        [--model-tokens 1,16,64,256,1024,8192] [--width-divisor 4] [--experts 8] [--top-k 2]
        [--weight-layout replicated] [--topology h100x8] [--json FILE]

Method and results: docs/measurements/2026-11-30-layer-share.md (and the files it links).
"""

import dataclasses
import functools
import itertools
from typing import Any

import numpy as np

import k3_tail
from k3_tail.cli.harness import AXIS_NAME, Experiment, ProgressBar, choice_list, positive_int_list, progress, stepped
from k3_tail.cli.tables import format_table, spread_ms
from k3_tail.deviceless.topologies import parse_topology
from k3_tail.models.kimi_k3 import (
    KIMI_K3_NUM_EXPERTS,
    KIMI_K3_TOP_K,
    LayerConfig,
    build_layer,
    compile_layer,
    cost as layer_cost,
)
from k3_tail.models.kimi_k3.mxfp4 import MXFP4_BYTES
from k3_tail.models.kimi_k3.parameters import ROUTED_EXPERT_WEIGHTS
from k3_tail.models.kimi_k3.per_rank import up_projection
from k3_tail.models.kimi_k3.routed_experts import routed_expert_method
from k3_tail.models.kimi_k3.schedule import shared_reduction_placement
from k3_tail.tools.benchmark import Timing, tiers_for, time_round_robin
from k3_tail.xla import report as xla_report
from kimi_k3_routed_experts_bench import add_layer_arguments, cpu_layer_config, random_hidden_states
from lab.blocks import WEIGHT_LAYOUTS

PARTS = ("cpu", "h100", "early", "cost", "model")
MODEL_HARDWARE, MODEL_TP_SIZE = "mi355x", 8
EARLY_REDUCTION_HARDWARE = ("mi355x", "h200")
EXPERT_PRECISIONS = {"bf16": None, "MXFP4": MXFP4_BYTES}
# vLLM's published end-to-end gains of its tail tiers over its base path (Kimi-K3, 8k input / 1k output).
VLLM_FIGURES = ("8 x MI355X: TTFT -5.1 .. -5.5 %, output throughput +3.05 .. +4.91 %; SM100 (B200): TTFT -4 %")
# The first columns of the tables whose rows are per (T, tier): a blank line where T changes.
T_COLUMNS = [("T", ">6", lambda r: r["num_tokens"]), ("", "2", lambda r: "")]
BY_TOKENS = {"group": lambda r: r["num_tokens"]}


def parse_args(experiment: Experiment, argv: list[str] | None):
    add = experiment.parser.add_argument
    add("--parts", type=choice_list(PARTS, "parts"), default=PARTS, metavar="PART,...",
        help=f"parts to run, of {', '.join(PARTS)} (default: all)")
    add("--tokens", type=positive_int_list, default=(1, 4, 16, 64, 256, 1024), metavar="T,...",
        help="cpu: token counts (default: 1,4,16,64,256,1024)")
    add_layer_arguments(experiment)
    add("--compile-tokens", type=positive_int_list, default=(1, 16, 256), metavar="T,...",
        help="h100, early: token counts to compile for (default: 1,16,256)")
    add("--cost-tokens", type=positive_int_list, default=(1, 16, 256, 2048, 8192), metavar="T,...",
        help="cost: token counts to compile for (default: 1,16,256,2048,8192)")
    add("--model-tokens", type=positive_int_list, default=(1, 16, 64, 256, 1024, 8192), metavar="T,...",
        help="model: token counts (default: 1,16,64,256,1024,8192)")
    add("--weight-layout", choices=WEIGHT_LAYOUTS, default="replicated",
        help="where the up projection lives (default: replicated, as vLLM serves it)")
    add("--topology", default="h100x8", metavar="NAME",
        help="h100, early, cost: the deviceless GPU topology to compile for (default h100x8)")
    args = experiment.parse(argv)
    cpu_layer_config(experiment, early_shared_reduction=False)  # a usage error unless the CPU mesh splits it
    try:
        parse_topology(args.topology)
    except ValueError as error:
        experiment.parser.error(f"--topology: {error}")
    return args


def kimi_k3_layer(**fields: Any) -> LayerConfig:
    """The layer at Kimi-K3's shapes: 896 experts, top 16, bf16, with ``fields``."""
    return LayerConfig.kimi_k3(num_experts=KIMI_K3_NUM_EXPERTS, top_k=KIMI_K3_TOP_K, **fields)


def gpu_tier(config: LayerConfig, num_tokens: int, tp_size: int, weight_layout: str) -> k3_tail.Tier:
    """The tier the layer's tail selects on a GPU (vLLM's rule)."""
    return k3_tail.select_tier(config.tail, num_tokens, tp_size, weight_layout=weight_layout, platform="gpu").tier


def compiled_flops(config: LayerConfig, mesh, num_tokens: int, weight_layout: str, tier: k3_tail.Tier | None):
    """(The layer compiled for ``mesh`` with ``tier``, or the one it selects when None; its XLA report; the
    layer's useful GEMM FLOPs per rank with ``tier``, or the selected one)."""
    compiled = compile_layer(config, mesh, num_tokens, weight_layout=weight_layout, tier=tier)
    useful = layer_cost.layer_flops(config.sizes, num_tokens, mesh.shape[AXIS_NAME], weight_layout=weight_layout,
                                    tier=tier or gpu_tier(config, num_tokens, mesh.shape[AXIS_NAME], weight_layout))
    return compiled, xla_report.report(compiled, shared_argument=None), useful


def compiled_layer(args) -> str:
    """What the h100, early and cost parts compile, for their titles."""
    return (f"the layer compiled for a deviceless {args.topology} (Kimi-K3: {KIMI_K3_NUM_EXPERTS} experts, top "
            f"{KIMI_K3_TOP_K}, bf16, {args.weight_layout} up projection)")


# ---- cpu ----


def measure_cpu(experiment: Experiment) -> tuple[LayerConfig, list[dict[str, Any]]]:
    """One row per (T, tier): the layer's and the tail's timings on the CPU mesh (module docstring)."""
    args = experiment.args
    config = cpu_layer_config(experiment, early_shared_reduction=False)
    mesh = experiment.cpu_mesh
    layer = build_layer(config, mesh, seed=args.seed, weight_layout=args.weight_layout)
    parameters = layer.parameter_values()
    tiers = tiers_for(args.weight_layout)
    rng = np.random.default_rng(args.seed)
    bar = ProgressBar(len(args.tokens) * (2 * len(tiers) + args.repeats))
    rows = []
    for num_tokens in args.tokens:
        hidden = random_hidden_states(config, mesh, num_tokens, rng)
        routed, shared = layer.partials(hidden)
        calls = {}
        for tier in tiers:
            calls[tier.value, "layer"] = functools.partial(layer, hidden, tier=tier)
            calls[tier.value, "tail"] = functools.partial(
                k3_tail.tail_forward, routed, shared, parameters["norm_scale"], up_projection(parameters),
                config=config.tail, mesh=mesh, tier=tier, weight_layout=args.weight_layout)
        seconds = time_round_robin(calls, rounds=args.repeats, warmup=args.warmup, on_progress=lambda message,
                                   tokens=num_tokens: bar.step(f"cpu T={tokens}: {message}"))
        selected = layer.plan(num_tokens).tier
        native_median = float(np.median(seconds["native", "layer"]))
        for tier in tiers:
            layer_timing, tail_timing = Timing.of(seconds[tier.value, "layer"]), Timing.of(seconds[tier.value, "tail"])
            rows.append({
                "num_tokens": num_tokens, "tier": tier.value, "selected": tier == selected,
                "layer_s": layer_timing, "tail_s": tail_timing,
                "tail_share": tail_timing.median_s / layer_timing.median_s,
                "layer_speedup_vs_native": native_median / layer_timing.median_s,
            })
    bar.finish()
    return config, rows


def format_cpu(config: LayerConfig, rows: list[dict[str, Any]], args) -> str:
    return "\n".join([
        f"cpu: the layer on {args.devices} CPU devices: H={config.hidden_size}, L={config.latent_size}, "
        f"m={config.expert_intermediate_size}, F={config.shared_intermediate_size} (Kimi-K3 / {args.width_divisor}), "
        f"{config.num_experts} experts, top {config.top_k}, {config.dtype.name}, {args.weight_layout} up projection; "
        f"{args.warmup} warm-up + {args.repeats} rounds", format_table(rows, [
            *T_COLUMNS, ("tier", "<17", lambda r: r["tier"] + (" *" if r["selected"] else "")),
            ("layer ms (q25-q75)", ">24", lambda r: spread_ms(r["layer_s"])),
            ("tail ms (q25-q75)", ">24", lambda r: spread_ms(r["tail_s"])),
            ("tail share", ">12.1%", lambda r: r["tail_share"]),
            ("layer vs native", ">17", lambda r: f"{r['layer_speedup_vs_native']:.2f}x"),
        ], **BY_TOKENS, notes=["* the tier the tail selects for that T (vLLM's rule); tail share: tail median / layer "
                               "median"])])


# ---- h100 ----


def compile_h100(experiment: Experiment) -> tuple[LayerConfig, list[dict[str, Any]]]:
    """One row per (T, tier): the shared reduction of the compiled 8 x H100 layer (module docstring)."""
    args = experiment.args
    config = kimi_k3_layer(early_shared_reduction=False)
    mesh = k3_tail.topology_mesh(args.topology)
    rows = []
    for num_tokens, tier in stepped(itertools.product(args.compile_tokens, tiers_for(args.weight_layout)),
                                    lambda case: f"h100 T={case[0]} {case[1].value}: compile"):
        _, report, useful = compiled_flops(config, mesh, num_tokens, args.weight_layout, tier)
        rows.append({"num_tokens": num_tokens, "tier": tier.value, **shared_reduction_schedule(report),
                     "compiled_gemm_flops": report.gemm_flops, "useful_gemm_flops": useful})
    return config, rows


def shared_reduction_schedule(report: k3_tail.XlaReport) -> dict[str, Any]:
    """The shared reduction, whether it is async, the GEMMs inside it and the up projection's share of
    them (module docstring: h100)."""
    named = [c for c in report.collectives if {"shared_reduction", "packed_reduction"} & set(c.scopes)]
    shared = (named or [c for c in report.collectives if not c.scopes])[0]
    gemms = {gemm.name: gemm for gemm in report.gemms}
    inside = [gemms[name] for name in shared.between_gemms]
    up_flops = sum(gemm.flops for gemm in report.gemms if "up_projection" in gemm.scopes)
    inside_flops = sum(gemm.flops for gemm in inside if "up_projection" in gemm.scopes)
    return {
        "shared_reduction": f"{shared.kind} {' + '.join(map(str, shared.arrays))}",
        "is_async": shared.is_async,
        "gemms_inside": [{"name": gemm.name, "flops": gemm.flops, "position": gemm.position} for gemm in inside],
        "up_projection_inside": inside_flops / up_flops,
        "overlapped": shared.is_async and inside_flops >= up_flops,
    }


def gemms_inside(row: dict[str, Any]) -> str:
    inside = row["gemms_inside"]
    return f"{len(inside)} ({sum(gemm['flops'] for gemm in inside) / 1e9:.3f})" if inside else "-"


def format_h100(config: LayerConfig, rows: list[dict[str, Any]], args) -> str:
    return f"h100: {compiled_layer(args)}, each tier with its compiler options\n" + format_table(rows, [
        *T_COLUMNS, ("tier", "<17", lambda r: r["tier"]),
        ("shared reduction", "<48", lambda r: r["shared_reduction"]),
        ("async", "<7", lambda r: "yes" if r["is_async"] else "no"), ("GEMMs inside (GFLOP)", ">21", gemms_inside),
        ("up projection inside", ">22.0%", lambda r: r["up_projection_inside"]),
        ("overlapped", ">12", lambda r: str(r["overlapped"])),
        ("GEMM GFLOP/rank: compiled / useful", ">37",
         lambda r: f"{r['compiled_gemm_flops'] / 1e9:.1f} / {r['useful_gemm_flops'] / 1e9:.1f}"),
    ], **BY_TOKENS, notes=[
        "up projection inside: the share of the tier's up-projection FLOPs scheduled between the shared",
        "reduction's start and done; overlapped: async, with all of it inside. useful GEMM FLOPs: the layer's",
        "(k3_tail.models.kimi_k3.cost)"])


# ---- early ----


def compile_early(experiment: Experiment) -> tuple[LayerConfig, list[dict[str, Any]]]:
    """One row per (T, early or not): where the shared reduction runs in the compiled layer (module docstring)."""
    args = experiment.args
    mesh = k3_tail.topology_mesh(args.topology)
    rows = []
    for num_tokens, early in stepped(itertools.product(args.compile_tokens, (False, True)), lambda case:
                                     f"early T={case[0]} {'early' if case[1] else 'in the tail'}: compile"):
        config = kimi_k3_layer(early_shared_reduction=early)
        tier = gpu_tier(config, num_tokens, mesh.shape[AXIS_NAME], args.weight_layout)
        compiled = compile_layer(config, mesh, num_tokens, weight_layout=args.weight_layout)
        placement = shared_reduction_placement(compiled, ROUTED_EXPERT_WEIGHTS)
        rows.append({"num_tokens": num_tokens, "early_shared_reduction": early, "tier": tier.value,
                     **dataclasses.asdict(placement),
                     "starts_before_the_routed_experts": placement.starts_before_the_routed_experts,
                     "ends_after_the_routed_experts": placement.ends_after_the_routed_experts,
                     "routed_share_inside": placement.routed_share_inside})
    return config, rows


def format_early(config: LayerConfig, rows: list[dict[str, Any]], args) -> str:
    return (f"early: where the shared reduction runs in {compiled_layer(args)}, the tier it selects; schedule "
            "positions\n") + format_table(rows, [
        *T_COLUMNS,
        ("shared reduction", "<18", lambda r: "early" if r["early_shared_reduction"] else "in the tail"),
        ("tier", "<17", lambda r: r["tier"]), ("start..done", ">13", lambda r: f"{r['start']:>6}..{r['done']:<5}"),
        ("routed reads from", ">19", lambda r: r["first_routed_read"]),
        ("last routed", ">13", lambda r: r["last_routed"]),
        ("routed inside", ">15.0%", lambda r: r["routed_share_inside"]),
        ("starts before", ">15", lambda r: str(r["starts_before_the_routed_experts"])),
        ("ends after", ">12", lambda r: str(r["ends_after_the_routed_experts"])),
    ], notes=["routed inside: the share of the routed-expert instructions (those computed from a routed-expert "
              "weight", "before the latent reduction) scheduled between the shared reduction's start and done"])


# ---- cost ----


def compile_cost(experiment: Experiment) -> tuple[LayerConfig, list[dict[str, Any]]]:
    """One row per T: the cost of the layer compiled for 8 x H100 with the tier it selects (module docstring)."""
    args = experiment.args
    config = kimi_k3_layer()
    mesh = k3_tail.topology_mesh(args.topology)
    tp_size = mesh.shape[AXIS_NAME]
    expert_bytes = 3 * config.latent_size * config.expert_intermediate_size // tp_size * config.dtype.itemsize
    rows = []
    for num_tokens in stepped(args.cost_tokens, lambda tokens: f"cost T={tokens}: compile"):
        compiled, report, useful = compiled_flops(config, mesh, num_tokens, args.weight_layout, None)
        rows.append({
            "num_tokens": num_tokens, "tier": gpu_tier(config, num_tokens, tp_size, args.weight_layout).value,
            "routed_expert_method": routed_expert_method(config, num_tokens).method,
            "compiled_gemm_flops": report.gemm_flops, "useful_flops": useful,
            "bytes_accessed": report.bytes_accessed, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "routed_weight_bytes_read": expert_bytes * layer_cost.experts_read(config.sizes, num_tokens),
        })
    return config, rows


def format_cost(config: LayerConfig, rows: list[dict[str, Any]], args) -> str:
    return f"cost: {compiled_layer(args)} with the tier and routed-expert method it selects\n" + format_table(rows, [
        *T_COLUMNS, ("tier", "<17", lambda r: r["tier"]), ("method", "<10", lambda r: r["routed_expert_method"]),
        ("GEMM GFLOP compiled / useful", ">30",
         lambda r: f"{r['compiled_gemm_flops'] / 1e9:,.1f} / {r['useful_flops'] / 1e9:,.1f}"),
        ("ratio", ">8", lambda r: f"{r['compiled_gemm_flops'] / r['useful_flops']:.2f}x"),
        ("GB accessed", ">13.2f", lambda r: r["bytes_accessed"] / 1e9),
        ("temp MB", ">11,.1f", lambda r: r["temp_bytes"] / 1e6),
        ("temp / routed weights read", ">28", lambda r: f"{r['temp_bytes'] / r['routed_weight_bytes_read']:.2f}x"),
    ], notes=["GEMM FLOPs from the HLO shapes (a while loop's body once; the gather method's multiply + reduce",
              "fusions are not GEMMs); GB accessed: the XLA report's HLO-shape estimate (a gathering fusion counts "
              "its", "whole weight operand); routed weights read: 3 L m/p bf16 per expected distinct expert"])


# ---- model ----


def predict_model(experiment: Experiment) -> tuple[LayerConfig, list[dict[str, Any]]]:
    """One row per (expert weight precision, T): the layer's predicted time with native and each tier's gain."""
    args = experiment.args
    config = kimi_k3_layer(early_shared_reduction=False)
    tiers = tiers_for(args.weight_layout)
    rows = []
    for (precision, expert_bytes), num_tokens in itertools.product(EXPERT_PRECISIONS.items(), args.model_tokens):
        options = dict(weight_layout=args.weight_layout, expert_weight_bytes=expert_bytes)
        native = layer_cost.predict_layer(config.sizes, num_tokens, MODEL_TP_SIZE, tier=k3_tail.Tier.NATIVE,
                                          hardware=MODEL_HARDWARE, **options)
        rows.append({
            "expert_weights": precision, "num_tokens": num_tokens, "native_layer_s": native.total_s,
            "native_tail_share": native.tail_share,
            "selected": gpu_tier(config, num_tokens, MODEL_TP_SIZE, args.weight_layout).value,
            "gain": {tier.value: layer_cost.layer_gain(config.sizes, num_tokens, MODEL_TP_SIZE, tier=tier,
                                                       hardware=MODEL_HARDWARE, **options) for tier in tiers},
            "early_reduction_gain": {name: layer_cost.early_reduction_gain(config.sizes, num_tokens, MODEL_TP_SIZE,
                                                                           hardware=name, **options)
                                     for name in EARLY_REDUCTION_HARDWARE},
        })
    return config, rows


def format_model(config: LayerConfig, rows: list[dict[str, Any]], args) -> str:
    tiers = [tier.value for tier in tiers_for(args.weight_layout) if tier != k3_tail.Tier.NATIVE]
    lines = [f"model: cost-model layer-level gain over native, {MODEL_HARDWARE.upper()} TP {MODEL_TP_SIZE}, Kimi-K3 "
             f"(896 experts, top 16), {args.weight_layout} up projection; the MoE layer alone"]
    for precision in EXPERT_PRECISIONS:
        lines += ["", f"routed experts' weights in {precision}:", format_table(
            [row for row in rows if row["expert_weights"] == precision], [
                T_COLUMNS[0], ("layer us (native)", ">19.1f", lambda r: r["native_layer_s"] * 1e6),
                ("tail share (native)", ">21.1%", lambda r: r["native_tail_share"]),
                *((tier, ">17", lambda r, tier=tier: f"{r['gain'][tier]:+.1%}") for tier in tiers),
                ("vLLM rule picks", ">22", lambda r: f"{r['selected']} ({r['gain'][r['selected']]:+.1%})")])]
    gains = [(name, precision) for name in EARLY_REDUCTION_HARDWARE for precision in EXPERT_PRECISIONS]
    by_key = {(row["expert_weights"], row["num_tokens"]): row for row in rows}
    lines += ["", f"vLLM's published end-to-end gains, for comparison: {VLLM_FIGURES}.",
              "Those are whole serving runs (every layer, attention, sampling); these are the MoE layer alone.", "",
              f"the shared reduction issued before the routed experts: layer-level gain over it inside the tail, each "
              f"with its fastest tier, TP {MODEL_TP_SIZE}, {args.weight_layout} up projection", format_table(
                  args.model_tokens, [("T", ">6", lambda t: t), *(
                      (f"{name}, {precision}", ">18", lambda t, name=name, precision=precision:
                       f"{by_key[precision, t]['early_reduction_gain'][name]:+.2%}") for name, precision in gains)])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__, repeats=3, warmup=1)
    args = parse_args(experiment, argv)
    experiment.cpu_mesh = experiment.mesh(accelerators=False)  # also keeps a GPU plugin from starting
    results: dict[str, Any] = {}
    sections = []
    for part in (part for part in PARTS if part in args.parts):
        produce, present = PART_STEPS[part]
        try:
            config, rows = produce(experiment)
        except k3_tail.TopologyUnavailable as error:  # the deviceless GPU parts need the [aot] extra
            progress(f"{part}: skipped: {error}")
            continue
        results[part] = {"config": describe(config), "rows": rows}
        sections.append(present(config, rows, args))
    experiment.print("\n\n".join(["", *sections]))
    return experiment.finish(**results)


# Each part: what computes its rows, and what prints them.
PART_STEPS = {"cpu": (measure_cpu, format_cpu), "h100": (compile_h100, format_h100),
              "early": (compile_early, format_early), "cost": (compile_cost, format_cost),
              "model": (predict_model, format_model)}


def describe(config: LayerConfig) -> dict[str, Any]:
    return {"hidden_size": config.hidden_size, "latent_size": config.latent_size, "num_experts": config.num_experts,
            "top_k": config.top_k, "expert_intermediate_size": config.expert_intermediate_size,
            "shared_intermediate_size": config.shared_intermediate_size, "dtype": config.dtype.name}


if __name__ == "__main__":
    raise SystemExit(main())
