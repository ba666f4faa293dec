"""What the cost model predicts quantised sums are worth: the fastest tier's time per codec against bf16 sums.

    python scripts/quantized_gain.py [--tokens 1,16,256,1024,2048,8192] [--json gains.json]

Method and results: docs/measurements/2026-12-01-quantized-sums.md, "Predicted worth on the GPUs".
"""

from __future__ import annotations

import bisect

from k3_tail import TailConfig
from k3_tail.cli.harness import Experiment, positive_int_list
from k3_tail.cli.tables import markdown_table
from k3_tail.selection import cost_model
from lab.blocks import CODEC_NAMES

PRESETS = ("mi355x", "mi300x", "h200")
TP_SIZE = 8
LAYOUT = "replicated"
WINDOWS = {"every sum": 0, "vLLM minimum": None}


def fastest_seconds(config: TailConfig, num_tokens: int, hardware: str) -> float:
    """The predicted time of the fastest tier for this call."""
    tier = cost_model.best_tier(config, num_tokens, TP_SIZE, hardware=hardware, weight_layout=LAYOUT).tier
    cost = cost_model.tier_cost(config, num_tokens, TP_SIZE, tier=tier, weight_layout=LAYOUT)
    return cost_model.predict_time(cost, hardware).total_s


def gain(codec: str, minimum: int | None, num_tokens: int, hardware: str) -> float:
    """1 - t(codec) / t(bf16) of the fastest tiers: > 0 where quantising is faster."""
    quantised = TailConfig.kimi_k3(all_reduce_quantization=codec, quantized_all_reduce_min_bytes=minimum)
    return 1 - fastest_seconds(quantised, num_tokens, hardware) / fastest_seconds(TailConfig.kimi_k3(), num_tokens,
                                                                                  hardware)


def break_even(codec: str, hardware: str, last: int = 16384) -> int | None:
    """The smallest T in [1, last] from which quantising every sum is predicted faster (bisection: the
    gain grows with T, as the bytes it saves do), or None when it never is."""
    index = bisect.bisect_left(range(1, last + 1), True, key=lambda tokens: gain(codec, 0, tokens, hardware) > 0)
    return index + 1 if index < last else None


def lasting(changes: tuple[cost_model.Crossover, ...]) -> list[cost_model.Crossover]:
    """The crossovers whose tier stays fastest for at least p tokens, each from the tier fastest before it."""
    kept: list[cost_model.Crossover] = []
    for change, following in zip(changes, [*changes[1:], None], strict=True):
        if following is None or following.num_tokens - change.num_tokens >= TP_SIZE:
            before = kept[-1].after if kept else changes[0].before
            if before is not change.after:
                kept.append(cost_model.Crossover(change.num_tokens, before, change.after))
    return kept


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__, devices=False)
    experiment.parser.add_argument("--tokens", type=positive_int_list, default=(1, 16, 256, 1024, 2048, 8192),
                                   metavar="T,T,...", help="token counts (default: 1,16,256,1024,2048,8192)")
    args = experiment.parse(argv)
    gains, table = [], []
    for hardware in PRESETS:
        for codec in CODEC_NAMES:
            for window, minimum in WINDOWS.items():
                values = [gain(codec, minimum, t, hardware) for t in args.tokens]
                even = break_even(codec, hardware) if minimum == 0 else None
                gains.append({"hardware": hardware, "codec": codec, "sums": window, "tokens": args.tokens,
                              "gain": values, "break_even_tokens": even})
                table.append([hardware, codec, window, *(f"{100 * g:+.1f}" for g in values),
                              "-" if minimum is None else even])
    experiment.print(f"fastest tier's predicted gain over bf16 sums, TP{TP_SIZE}, Kimi-K3, {LAYOUT} kernel (%)", "",
                     markdown_table(["GPU", "codec", "sums", *(f"T={t}" for t in args.tokens), "break-even T"], table),
                     "", "tier crossovers (from T on, `after` is fastest; changes undone within p tokens, where "
                     "token_parallel's", "rows round up to a multiple of p, left out), bf16 sums vs int4 with vLLM's "
                     "minimum:")
    crossovers = []
    for hardware in PRESETS:
        for label, codec in (("bf16", None), ("int4", "int4")):
            config = TailConfig.kimi_k3(all_reduce_quantization=codec)
            changes = lasting(cost_model.crossovers(config, TP_SIZE, hardware=hardware, weight_layout=LAYOUT))
            text = ", ".join(f"{c.before.value} -> {c.after.value} at {c.num_tokens}" for c in changes) or "none"
            experiment.print(f"  {hardware} {label}: {text}")
            crossovers.append({"hardware": hardware, "crossovers": label,
                               "changes": [[c.num_tokens, c.before.value, c.after.value] for c in changes]})
    return experiment.finish(gains=gains, crossovers=crossovers)


if __name__ == "__main__":
    raise SystemExit(main())
