"""What quantised sums (QuickReduce's INT8, INT6, INT4) cost in accuracy, at Kimi-K3's shapes, on every tier.

    python scripts/quantized_error.py [--devices 8] [--tokens 1,16,256,2048,8192] [--tiers native,...]
                                      [--codecs bf16,int8,int6,int4] [--large-tokens 8192 --large-tiers TIER,...]
                                      [--seed 0] [--json FILE]

Method and results: docs/measurements/2026-12-01-quantized-sums.md, "Accuracy".
"""

import time

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from k3_tail import TailConfig, Tier, tail_forward
from k3_tail.cli.harness import (
    AXIS_NAME,
    Experiment,
    ProgressBar,
    choice_list,
    positive_int,
    positive_int_list,
    tier_list,
)
from k3_tail.cli.tables import markdown_table
from k3_tail.tools.benchmark import place, tiers_for
from lab.accuracy import random_partials, random_weights, reference_tail, relative_error
from lab.blocks import CODEC_NAMES

BASELINE = "bf16"
CODEC_CHOICES = (BASELINE, *CODEC_NAMES)
DEFAULT_TOKENS = (1, 16, 256, 2048, 8192)
WEIGHT_LAYOUT = "replicated"


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__)
    add = experiment.parser.add_argument
    add("--tokens", type=positive_int_list, default=DEFAULT_TOKENS, metavar="T,T,...",
        help=f"token counts (default: {','.join(map(str, DEFAULT_TOKENS))})")
    add("--tiers", type=tier_list, default=None, metavar="TIER,...",
        help="tiers, comma-separated (default: every tier)")
    add("--codecs", type=choice_list(CODEC_CHOICES, "codecs"), default=CODEC_CHOICES, metavar="C,C,...",
        help=f"among {', '.join(CODEC_CHOICES)} ({BASELINE}: unquantised sums, the ratios' baseline; default: all)")
    add("--large-tokens", type=positive_int, default=8192, metavar="T",
        help="with --large-tiers: from this token count on run only those tiers (default: 8192)")
    add("--large-tiers", type=tier_list, default=None, metavar="TIER,...",
        help="the tiers to run at T >= --large-tokens (default: the same as at smaller T)")
    args = experiment.parse(argv)
    tiers = args.tiers or tiers_for(WEIGHT_LAYOUT)
    unsupported = [tier.value for tier in (*tiers, *(args.large_tiers or ())) if not tier.supports(WEIGHT_LAYOUT)]
    if unsupported:
        experiment.error(f"tiers {', '.join(unsupported)}: do not run with the {WEIGHT_LAYOUT} kernel")
    mesh = experiment.mesh()
    p = mesh.shape[AXIS_NAME]
    kimi = TailConfig.kimi_k3()
    rng = np.random.default_rng(args.seed)
    norm_weight, kernel = random_weights(kimi, rng)
    placed_norm, placed_kernel = (place(x, kimi, mesh, P()) for x in (norm_weight, kernel))

    def tiers_at(num_tokens: int) -> tuple[Tier, ...]:
        return args.large_tiers if args.large_tiers and num_tokens >= args.large_tokens else tiers

    configs = {codec: TailConfig.kimi_k3() if codec == BASELINE else TailConfig.kimi_k3(
        all_reduce_quantization=codec, quantized_all_reduce_min_bytes=0) for codec in args.codecs}
    bar = ProgressBar(sum(len(tiers_at(t)) * len(args.codecs) + 1 for t in args.tokens))
    rows = []
    for num_tokens in args.tokens:
        bar.step(f"T={num_tokens}: inputs and the float64 reference")
        routed, shared = random_partials(kimi, p, num_tokens, rng)
        exact = reference_tail(kimi, routed, shared, norm_weight, kernel)
        placed_routed, placed_shared = (place(x, kimi, mesh, P(AXIS_NAME)) for x in (routed, shared))
        del routed, shared
        for tier in tiers_at(num_tokens):
            for codec in args.codecs:
                bar.step(f"T={num_tokens} {tier.value} {codec}")
                began = time.perf_counter()
                y = tail_forward(placed_routed, placed_shared, placed_norm, placed_kernel, config=configs[codec],
                                 mesh=mesh, tier=tier, weight_layout=WEIGHT_LAYOUT)
                error = relative_error(np.asarray(y), exact)
                rows.append({"num_tokens": num_tokens, "tier": tier.value, "codec": codec,
                             "quantized_all_reduce_min_bytes": None if codec == BASELINE else 0,
                             "relative_error": error, "seconds_with_compile": time.perf_counter() - began})
                del y
        del placed_routed, placed_shared, exact
        jax.clear_caches()  # each (T, tier, codec) runs once: its executable is not needed again
    bar.finish()
    baseline = {(r["num_tokens"], r["tier"]): r["relative_error"] for r in rows if r["codec"] == BASELINE}
    for row in rows:
        base = baseline.get((row["num_tokens"], row["tier"]))
        row["vs_bf16"] = row["relative_error"] / base if base else None
    defaults = default_sizes(args.tokens, p, kimi)
    experiment.print(
        "", f"Kimi-K3 tail (H={kimi.hidden_size}, L={kimi.latent_size}, bf16), p={p} {mesh.devices.flat[0].platform} "
        f"devices, {WEIGHT_LAYOUT} kernel; ||y - y_ref|| / ||y_ref|| against the float64 reference; quantised codecs "
        "with quantized_all_reduce_min_bytes=0 (every sum quantised)", "", error_table(rows, args.codecs), "",
        f"With vLLM's default minimum sizes (quantized_all_reduce_min_bytes=None, p={p}, bf16 on the float16 table): "
        "the sums that are quantised", "", default_table(defaults, p))
    return experiment.finish(tp_size=p, rows=rows, default_minimum_sizes=defaults)


def default_sizes(tokens, p: int, config: TailConfig) -> list[dict]:
    """Per T, the tail's sum buffers in bytes and which of them each codec quantises under vLLM's minimum."""
    widths = {"latent [T, L]": config.latent_size, "[T, H]": config.hidden_size,
              "one_shot [T, 2H+L]": 2 * config.hidden_size + config.latent_size}
    configs = {codec: TailConfig.kimi_k3(all_reduce_quantization=codec) for codec in CODEC_NAMES}
    entries = []
    for num_tokens in tokens:
        buffers = {name: num_tokens * width * config.dtype.itemsize for name, width in widths.items()}
        entries.append({
            "num_tokens": num_tokens, "buffer_bytes": buffers,
            "quantized": {codec: [name for name, nbytes in buffers.items() if c.sum_plan(p).codec_for(nbytes)]
                          for codec, c in configs.items()},
            "min_bytes": {codec: c.quantization_min_bytes(p) for codec, c in configs.items()}})
    return entries


def error_table(rows: list[dict], codecs) -> str:
    quantised = [codec for codec in codecs if codec != BASELINE]
    cells = {(r["num_tokens"], r["tier"], r["codec"]): r for r in rows}
    return markdown_table(["T", "tier", *codecs, *(f"{codec}/{BASELINE}" for codec in quantised)], [
        [num_tokens, tier, *(f"{cells[num_tokens, tier, c]['relative_error']:.2e}" for c in codecs),
         *(f"{cells[num_tokens, tier, c]['vs_bf16']:.2f}" if cells[num_tokens, tier, c]["vs_bf16"] is not None else "-"
           for c in quantised)]
        for num_tokens, tier in dict.fromkeys((r["num_tokens"], r["tier"]) for r in rows)])


def default_table(entries: list[dict], p: int) -> str:
    if not entries:
        return ""
    minimum = ", ".join(f"{codec} {entries[0]['min_bytes'][codec] / 2**20:g} MiB" for codec in CODEC_NAMES)
    names = list(entries[0]["buffer_bytes"])
    table = markdown_table(["T", *(f"{name} MiB" for name in names), *(f"{c} quantises" for c in CODEC_NAMES)], [
        [entry["num_tokens"], *(f"{entry['buffer_bytes'][name] / 2**20:.3g}" for name in names),
         *(", ".join(entry["quantized"][codec]) or "-" for codec in CODEC_NAMES)] for entry in entries])
    return "\n".join([f"minimum buffer sizes at p={p}: {minimum}", "", table, "",
                      "[T, H]: native, overlap and scatter_gather's shared sum, column_parallel's output sum; "
                      "token_parallel pads T to a multiple of p."])


if __name__ == "__main__":
    raise SystemExit(main())
