"""What quantised sums (QuickReduce's INT8, INT6, INT4) cost in accuracy, at Kimi-K3's shapes, on every tier.

    python scripts/quantized_error.py [--devices 8] [--tokens 1,16,256,2048,8192] [--tiers native,...]
                                      [--codecs bf16,int8,int6,int4] [--large-tokens 8192 --large-tiers TIER,...]
                                      [--seed 0] [--json FILE]

Inputs (bf16, drawn as the tests draw them, so that the routed and the shared term each carry about
half of y): routed partials randn / sqrt(p) [p, T, L], shared partials randn / sqrt(p) [p, T, H],
norm weight 1 + 0.1 randn [L], kernel randn / sqrt(L) [L, H]. The kernel and the norm weight are drawn
once; the partials once per T, placed on the mesh once and shared by every tier and codec.

Reference: per T, the float64 tail of those bf16 values on the host (numpy),
``y_ref = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i``.

Runs: for each T, every tier of --tiers (default: every tier; the replicated kernel layout, which
every tier runs on) runs ``k3_tail.tail_forward`` on a 1-d mesh of --devices CPU devices (all GPUs
when there are any) once per codec of --codecs: "bf16" is the unquantised baseline
(``all_reduce_quantization=None``: every sum moves bf16), int8 / int6 / int4 set
``all_reduce_quantization`` with ``quantized_all_reduce_min_bytes=0``, so that every sum of the tier
is quantised whatever its size and the codec's error shows at every T (vLLM's default minimum sizes
would leave the small-T sums unquantised: see the second table). Each (T, tier, codec) compiles once.
With --large-tiers, token counts of at least --large-tokens run only those tiers (the float64
reference and the GEMMs of the replicated-kernel tiers grow with T; on a small host the largest T is
slow for every tier).

Reported: the relative Frobenius error ||y - y_ref|| / ||y_ref|| (computed in float64) per
(T, tier, codec), and its ratio to the bf16 baseline of the same (T, tier). A markdown table, then a
second one: with vLLM's DEFAULT minimum sizes (``quantized_all_reduce_min_bytes=None``, the float16
table that bf16 follows by default, for the mesh's p) which of the tail's sums
``k3_tail.ops.collectives.quantized_codec`` quantises at each T: the [T, L] latent sum, a [T, H]
sum (the shared partials, or column_parallel's output) and one_shot's packed [T, 2H + L] sum.
Progress goes to stderr; --json FILE writes the machine, the settings and the rows. Exit status 0,
or 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3_tail import TailConfig, Tier, tail_forward
from k3_tail.cli.common import (
    AXIS_NAME, CommandError, ProgressBar, choice_list, positive_int, positive_int_list, tier_list, timing_mesh,
)
from k3_tail.ops.codecs import CODECS
from k3_tail.ops.collectives import quantization_min_bytes, quantized_codec

BASELINE = "bf16"
CODEC_CHOICES = (BASELINE, *CODECS)
DEFAULT_TOKENS = (1, 16, 256, 2048, 8192)
WEIGHT_LAYOUT = "replicated"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=positive_int, default=8, metavar="N",
                        help="CPU devices without a GPU (default: 8); with GPUs all GPUs are used")
    parser.add_argument("--tokens", type=positive_int_list, default=DEFAULT_TOKENS, metavar="T,T,...",
                        help=f"token counts (default: {','.join(map(str, DEFAULT_TOKENS))})")
    parser.add_argument("--tiers", type=tier_list, default=None, metavar="TIER,...",
                        help="tiers, comma-separated (default: every tier)")
    parser.add_argument("--codecs", type=choice_list(CODEC_CHOICES, "codecs"), default=CODEC_CHOICES,
                        metavar="C,C,...",
                        help=f"among {', '.join(CODEC_CHOICES)} ({BASELINE}: unquantised sums, the baseline of the "
                        f"ratios; default: all)")
    parser.add_argument("--large-tokens", type=positive_int, default=8192, metavar="T",
                        help="with --large-tiers: from this token count on run only those tiers (default: 8192)")
    parser.add_argument("--large-tiers", type=tier_list, default=None, metavar="TIER,...",
                        help="the tiers to run at T >= --large-tokens (default: the same as at smaller T)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the machine, the settings and the rows as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tiers = args.tiers or tuple(tier for tier in Tier if tier.supports(WEIGHT_LAYOUT))
    unsupported = [tier.value for tier in (*tiers, *(args.large_tiers or ())) if not tier.supports(WEIGHT_LAYOUT)]
    if unsupported:
        print(f"quantized_error.py: error: tiers {', '.join(unsupported)}: do not run with the {WEIGHT_LAYOUT} "
              "kernel", file=sys.stderr)
        return 2
    try:
        mesh, machine = timing_mesh(args.devices)
    except CommandError as error:
        print(f"quantized_error.py: error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    p = mesh.devices.size
    kimi = TailConfig.kimi_k3()
    latent, hidden = kimi.latent_size, kimi.hidden_size
    rng = np.random.default_rng(args.seed)
    kernel = _bf16(rng.standard_normal((latent, hidden), dtype=np.float32) / np.sqrt(latent))
    norm_weight = _bf16(1 + 0.1 * rng.standard_normal(latent, dtype=np.float32))
    replicated = NamedSharding(mesh, P())
    placed_kernel, placed_norm = jax.device_put(kernel, replicated), jax.device_put(norm_weight, replicated)
    kernel64 = kernel.astype(np.float64)

    def tiers_at(num_tokens: int) -> tuple[Tier, ...]:
        return args.large_tiers if args.large_tiers and num_tokens >= args.large_tokens else tiers

    bar = ProgressBar(sum(len(tiers_at(t)) * len(args.codecs) + 1 for t in args.tokens))
    rows = []
    for num_tokens in args.tokens:
        bar.step(f"T={num_tokens}: inputs and the float64 reference")
        routed = _bf16(rng.standard_normal((p, num_tokens, latent), dtype=np.float32) / np.sqrt(p))
        shared = _bf16(rng.standard_normal((p, num_tokens, hidden), dtype=np.float32) / np.sqrt(p))
        exact = _reference(routed, shared, norm_weight.astype(np.float64), kernel64, kimi)
        exact_norm = float(np.linalg.norm(exact))
        by_rank = NamedSharding(mesh, P(AXIS_NAME))
        placed_routed, placed_shared = jax.device_put(routed, by_rank), jax.device_put(shared, by_rank)
        del routed, shared
        for tier in tiers_at(num_tokens):
            for codec in args.codecs:
                bar.step(f"T={num_tokens} {tier.value} {codec}")
                config = _config(codec)
                began = time.perf_counter()
                y = tail_forward(placed_routed, placed_shared, placed_norm, placed_kernel, config=config, mesh=mesh,
                                 tier=tier, weight_layout=WEIGHT_LAYOUT)
                y = np.asarray(y).astype(np.float64)
                seconds = time.perf_counter() - began
                rows.append({"num_tokens": num_tokens, "tier": tier.value, "codec": codec,
                             "quantized_all_reduce_min_bytes": None if codec == BASELINE else 0,
                             "relative_error": float(np.linalg.norm(y - exact)) / exact_norm,
                             "seconds_with_compile": seconds})
                del y
        del placed_routed, placed_shared, exact
        jax.clear_caches()  # each (T, tier, codec) runs once: its executable is not needed again
    bar.finish()
    baseline = {(r["num_tokens"], r["tier"]): r["relative_error"] for r in rows if r["codec"] == BASELINE}
    for row in rows:
        base = baseline.get((row["num_tokens"], row["tier"]))
        row["vs_bf16"] = row["relative_error"] / base if base else None
    defaults = _default_sizes(args.tokens, p, kimi)
    elapsed = time.perf_counter() - started

    print()
    print(f"Kimi-K3 tail (H={hidden}, L={latent}, bf16), p={p} {mesh.devices.flat[0].platform} devices, "
          f"{WEIGHT_LAYOUT} kernel; ||y - y_ref|| / ||y_ref|| against the float64 reference; quantised codecs with "
          "quantized_all_reduce_min_bytes=0 (every sum quantised)")
    print()
    print(format_error_table(rows, args.codecs))
    print()
    print(f"With vLLM's default minimum sizes (quantized_all_reduce_min_bytes=None, p={p}, bf16 on the float16 "
          "table): the sums quantized_codec quantises")
    print()
    print(format_default_table(defaults, p))
    print()
    print(f"elapsed {elapsed:.0f} s")
    if args.json:
        settings = {name: value for name, value in vars(args).items() if name != "json"}
        for name in ("tiers", "large_tiers"):
            settings[name] = None if settings[name] is None else [tier.value for tier in settings[name]]
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"machine": machine, "settings": settings, "tp_size": p, "elapsed_s": elapsed, "rows": rows,
                       "default_minimum_sizes": defaults}, file, indent=2)
        print(f"wrote {args.json}")
    return 0


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=jnp.bfloat16)


def _config(codec: str) -> TailConfig:
    if codec == BASELINE:
        return TailConfig.kimi_k3()
    return TailConfig.kimi_k3(all_reduce_quantization=codec, quantized_all_reduce_min_bytes=0)


def _reference(routed: np.ndarray, shared: np.ndarray, norm_weight: np.ndarray, kernel: np.ndarray,
               config: TailConfig) -> np.ndarray:
    """The float64 tail of the bf16 inputs, summed rank by rank (no float64 copy of the partials)."""
    latent = np.zeros(routed.shape[1:], np.float64)
    for partial in routed:
        latent += partial.astype(np.float64)
    latent *= config.routed_scaling_factor
    latent *= norm_weight / np.sqrt(np.mean(latent * latent, axis=-1, keepdims=True) + config.rms_norm_eps)
    y = latent @ kernel
    for partial in shared:
        y += partial.astype(np.float64)
    return y


def _default_sizes(tokens, p: int, config: TailConfig) -> list[dict]:
    """Per T, the tail's sum buffers in bytes and the codec each travels in under vLLM's default minimum."""
    itemsize = config.dtype.itemsize
    latent, hidden = config.latent_size, config.hidden_size
    widths = {"latent [T, L]": latent, "[T, H]": hidden, "one_shot [T, 2H+L]": 2 * hidden + latent}
    entries = []
    for num_tokens in tokens:
        buffers = {name: num_tokens * width * itemsize for name, width in widths.items()}
        quantised = {}
        for codec in CODECS:
            codec_config = TailConfig.kimi_k3(all_reduce_quantization=codec)
            quantised[codec] = [name for name, nbytes in buffers.items()
                                if quantized_codec(codec_config, nbytes, p) is not None]
        entries.append({"num_tokens": num_tokens, "buffer_bytes": buffers, "quantized": quantised})
    for codec in CODECS:
        minimum = quantization_min_bytes(TailConfig.kimi_k3(all_reduce_quantization=codec), p)
        for entry in entries:
            entry.setdefault("min_bytes", {})[codec] = minimum
    return entries


def format_error_table(rows: list[dict], codecs) -> str:
    quantised = [codec for codec in codecs if codec != BASELINE]
    header = ["T", "tier", *codecs, *(f"{codec}/{BASELINE}" for codec in quantised)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    cells = {(r["num_tokens"], r["tier"], r["codec"]): r for r in rows}
    for num_tokens, tier in dict.fromkeys((r["num_tokens"], r["tier"]) for r in rows):
        errors = [f"{cells[num_tokens, tier, c]['relative_error']:.2e}" for c in codecs]
        ratios = [_ratio(cells[num_tokens, tier, c]["vs_bf16"]) for c in quantised]
        lines.append("| " + " | ".join([str(num_tokens), tier, *errors, *ratios]) + " |")
    return "\n".join(lines)


def format_default_table(entries: list[dict], p: int) -> str:
    minimum = ", ".join(f"{codec} {entries[0]['min_bytes'][codec] / 2**20:g} MiB" for codec in CODECS) if entries \
        else ""
    names = list(entries[0]["buffer_bytes"]) if entries else []
    header = ["T", *(f"{name} MiB" for name in names), *(f"{codec} quantises" for codec in CODECS)]
    lines = [f"minimum buffer sizes at p={p}: {minimum}", "",
             "| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    for entry in entries:
        sizes = [f"{entry['buffer_bytes'][name] / 2**20:.3g}" for name in names]
        quantised = [", ".join(entry["quantized"][codec]) or "-" for codec in CODECS]
        lines.append("| " + " | ".join([str(entry["num_tokens"]), *sizes, *quantised]) + " |")
    lines += ["", "[T, H]: native, overlap and scatter_gather's shared sum, column_parallel's output sum; "
              "token_parallel pads T to a multiple of p."]
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
