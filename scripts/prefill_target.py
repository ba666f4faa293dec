"""Every tier against the column tier as it was before token_parallel and split all-reduces, in one run.

    python scripts/prefill_target.py [--tokens 16,1024] [--devices 8] [--rounds 5] [--json FILE]

The baseline is column_parallel with the column kernel layout and ``all_reduce_form="all-reduce"``:
the program the column tier compiled to before the library chose the form of its all-reduces
(one XLA all-reduce each, as the library always did then). Every tier then runs with the default
``all_reduce_form="auto"`` (on CPU, bfloat16 sums of >= 8 MiB run as reduce-scatter + all-gather),
with each weight layout it supports, for replicated output and for token-sharded output
(``sequence_parallel=True``; the baseline then is the column tier's token-sharded form).

Timing: Kimi-K3 shapes (bf16) on a 1-d TP mesh (all GPUs, or --devices forced CPU devices). Inputs
are placed on the mesh first; every variant runs once to compile, then --rounds rounds each run
every variant once (round robin), so load drifts hit all of them alike. Reported per variant: the
median and quartiles, and its median over the baseline's median (below 1: faster than before).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import numpy as np

from k3_tail import TailConfig, Tier, tail_forward
from k3_tail.cli.common import (
    CommandError, add_timing_arguments, format_ms, positive_int_list, progress, timing_mesh,
)
from k3_tail.tools.benchmark import Timing, machine_info, place_partials, place_weights, time_round_robin

BASELINE = ("column_parallel", "column", "all-reduce")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int_list, default=(16, 1024), metavar="T,T,...",
                        help="token counts (default: 16,1024)")
    add_timing_arguments(parser, rounds=5)
    args = parser.parse_args(argv)
    try:
        mesh, machine = timing_mesh(args.devices)
    except CommandError as error:
        print(f"prefill_target.py: error: {error}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    kimi = TailConfig.kimi_k3()
    weights = {layout: place_weights(kimi, mesh, layout, rng) for layout in ("column", "replicated")}
    rows = []
    for num_tokens in args.tokens:
        routed, shared = place_partials(kimi, mesh, num_tokens, rng)
        for sequence_parallel in (False, True):
            rows += measure_variants(mesh, weights, routed, shared, num_tokens, sequence_parallel, args.rounds)
    print_table(rows)
    print(f"load average {machine_info()['load_average_1min']:.2f} at the end")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as stream:
            json.dump({"machine": machine, "rounds": args.rounds, "rows": rows}, stream, indent=2)
    return 0


def variants(sequence_parallel: bool) -> list[tuple[str, str, str]]:
    """(tier, layout, all_reduce_form): the baseline first, then every tier with each layout it runs with."""
    config = TailConfig.kimi_k3(sequence_parallel=sequence_parallel)
    return [BASELINE, *((tier.value, layout, "auto") for tier in Tier for layout in ("column", "replicated")
                        if tier.supports(layout, config))]


def measure_variants(mesh, weights, routed, shared, num_tokens, sequence_parallel, rounds) -> list[dict]:
    output = "token-sharded" if sequence_parallel else "replicated"
    calls = {}
    for tier, layout, form in variants(sequence_parallel):
        config = TailConfig.kimi_k3(sequence_parallel=sequence_parallel, all_reduce_form=form)
        calls[tier, layout, form] = functools.partial(tail_forward, routed, shared, *weights[layout], config=config,
                                                      mesh=mesh, tier=tier, weight_layout=layout)
    seconds = time_round_robin(calls, rounds=rounds,
                               on_progress=lambda message: progress(f"T={num_tokens} {output}: {message}"))
    baseline = Timing.of(seconds[BASELINE]).median_s
    return [{"num_tokens": num_tokens, "output": output, "tier": tier, "weight_layout": layout,
             "all_reduce_form": form, **dataclasses.asdict(Timing.of(runs)),
             "vs_baseline": Timing.of(runs).median_s / baseline, "seconds": runs}
            for (tier, layout, form), runs in seconds.items()]


def print_table(rows: list[dict]) -> None:
    print(f"{'T':>5}  {'output':<14}{'tier':<16}{'layout':<11}{'all-reduce form':<27}{'median ms':>10}"
          f"{'q25-q75 ms':>18}{'vs before':>10}")
    for row in rows:
        spread = f"{format_ms(row['q25_s'])}-{format_ms(row['q75_s'])}"
        label = "before" if (row["tier"], row["weight_layout"], row["all_reduce_form"]) == BASELINE else ""
        print(f"{row['num_tokens']:>5}  {row['output']:<14}{row['tier']:<16}{row['weight_layout']:<11}"
              f"{row['all_reduce_form']:<27}{format_ms(row['median_s']):>10}{spread:>18}"
              f"{row['vs_baseline']:>9.2f}x {label}")


if __name__ == "__main__":
    raise SystemExit(main())
