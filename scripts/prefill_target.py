"""Every tier against the column tier as it was before token_parallel and split all-reduces, in one run.

    python scripts/prefill_target.py [--tokens 16,1024] [--devices 8] [--rounds 5] [--json FILE]

Method and results: docs/measurements/2026-11-30-prefill-target.md.
"""

import functools

import numpy as np

from k3_tail import TailConfig, Tier, tail_forward
from k3_tail.cli.harness import Experiment, positive_int_list, progress
from k3_tail.cli.tables import format_table, median_columns
from k3_tail.tools.benchmark import Timing, place_partials, place_weights, time_round_robin
from lab.blocks import WEIGHT_LAYOUTS

BASELINE = ("column_parallel", "column", "all-reduce")


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__, repeats=5)
    experiment.parser.add_argument("--tokens", type=positive_int_list, default=(16, 1024), metavar="T,T,...",
                                   help="token counts (default: 16,1024)")
    args = experiment.parse(argv)
    mesh = experiment.mesh()
    rng = np.random.default_rng(args.seed)
    kimi = TailConfig.kimi_k3()
    weights = {layout: place_weights(kimi, mesh, layout, rng) for layout in WEIGHT_LAYOUTS}
    rows = []
    for num_tokens in args.tokens:
        routed, shared = place_partials(kimi, mesh, num_tokens, rng)
        for sequence_parallel in (False, True):
            output = "token-sharded" if sequence_parallel else "replicated"
            calls = {}
            for tier, layout, form in variants(sequence_parallel):
                config = TailConfig.kimi_k3(sequence_parallel=sequence_parallel, all_reduce_form=form)
                calls[tier, layout, form] = functools.partial(
                    tail_forward, routed, shared, *weights[layout], config=config, mesh=mesh, tier=tier,
                    weight_layout=layout)
            seconds = time_round_robin(calls, rounds=args.repeats,
                                       on_progress=lambda message, where=f"T={num_tokens} {output}": progress(
                                           f"{where}: {message}"))
            baseline = Timing.of(seconds[BASELINE]).median_s
            rows += [{"num_tokens": num_tokens, "output": output, "tier": tier, "weight_layout": layout,
                      "all_reduce_form": form, "timing": Timing.of(runs),
                      "vs_baseline": Timing.of(runs).median_s / baseline, "seconds": runs}
                     for (tier, layout, form), runs in seconds.items()]
    experiment.print(format_table(rows, [
        ("T", ">5", lambda r: r["num_tokens"]), ("", "2", lambda r: ""), ("output", "<14", lambda r: r["output"]),
        ("tier", "<16", lambda r: r["tier"]), ("layout", "<11", lambda r: r["weight_layout"]),
        ("all-reduce form", "<27", lambda r: r["all_reduce_form"]),
        *median_columns(lambda r: r["timing"], (10, 18)),
        ("vs before", ">10", lambda r: f"{r['vs_baseline']:.2f}x"),
        ("", "", lambda r: " before" if (r["tier"], r["weight_layout"], r["all_reduce_form"]) == BASELINE else ""),
    ]))
    return experiment.finish(rows=rows)


def variants(sequence_parallel: bool) -> list[tuple[str, str, str]]:
    """(tier, layout, all_reduce_form): the baseline first, then every tier with each layout it runs with."""
    config = TailConfig.kimi_k3(sequence_parallel=sequence_parallel)
    return [BASELINE, *((tier.value, layout, "auto") for tier in Tier for layout in WEIGHT_LAYOUTS
                        if tier.supports(layout, config))]


if __name__ == "__main__":
    raise SystemExit(main())
