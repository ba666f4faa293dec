"""``k3-tail calibrate``: measure the tiers on this mesh and write a selection table.

Measures the tiers as ``bench`` does (the same measurement flags), on one TP size (``--tp-size``:
the first P devices, default all), keeps the fastest tier per token count and writes the token
ranges -> tier table as JSON (:class:`k3_tail.selection.table.SelectionTable`) to ``--out``, for
``TailConfig(selection_policy=SelectionTable.load(FILE))``. The table is
valid for this device kind, TP size, kernel layout, shapes and dtype only. It warns where a winner is
within the noise of the runs (its q25-q75 range overlaps the runner-up's: more ``--repeats`` may
pick the other) and says that the last range, above the largest T measured, is extrapolated. Every
argument is checked before anything is measured; a bad one is a one-line error (exit status 2).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import jax

from k3_tail.cli.harness import CommandError, check_output_flag, demo_devices, positive_int, tp_mesh
from k3_tail.cli.measurement import add_measurement_arguments, measure, measurement_config, measurement_tiers
from k3_tail.cli.tables import describe_config, format_bench_table, format_percent, within_noise
from k3_tail.hardware import device_platform
from k3_tail.selection.table import table_from_measurements
from k3_tail.tools.benchmark import Measurement, default_token_counts
from k3_tail.units import format_seconds

HELP = "measure the tiers on this mesh and write a selection table (JSON) for TailConfig.selection_policy"
DESCRIPTION = (
    "Time every tier at each token count on this machine's mesh (forced CPU devices without a GPU), keep the fastest "
    "per T and write the token ranges -> tier table as JSON. Load it with "
    "TailConfig(selection_policy=SelectionTable.load(FILE)); it is valid for this device kind, TP size, kernel "
    "layout, shapes and dtype only."
)


def add_arguments(calibrate: argparse.ArgumentParser) -> None:
    """``calibrate``'s flags: where the table goes, the TP size and the measurement flags."""
    calibrate.add_argument("--out", required=True, metavar="FILE.json", help="where to write the table")
    calibrate.add_argument(
        "--tp-size", type=positive_int, metavar="P", help="TP size: the first P devices (default: all devices)"
    )
    add_measurement_arguments(calibrate)


def run(args: argparse.Namespace) -> int:
    """The ``calibrate`` command: measure, build the table, write it, print it."""
    config = measurement_config(args)
    check_output_flag("--out", args.out)
    devices = demo_devices(args.devices)
    tiers = measurement_tiers(args.tiers, args.weight_layout, config, device_platform(devices[0]))
    tp_size = args.tp_size or len(devices)
    if tp_size > len(devices):
        raise CommandError(f"--tp-size: {tp_size} is more than the {len(devices)} devices")
    tokens = args.tokens or default_token_counts(devices[0].platform)
    device_kind = devices[0].device_kind
    print(f"calibrating on p={tp_size} {device_kind} devices; config: {describe_config(config)}; "
          f"kernel layout {args.weight_layout}")
    print(f"T in {','.join(map(str, tokens))}; tiers {', '.join(t.value for t in tiers)}; "
          f"{args.warmup} warm-up + {args.repeats} timed runs each", flush=True)
    measurements = measure(args, config, tiers, tokens, [tp_mesh(devices[:tp_size])])
    source = (f"k3-tail calibrate, {time.strftime('%Y-%m-%d')}, jax {jax.__version__}, "
              f"T={','.join(map(str, tokens))}, {args.repeats} repeats")
    table = table_from_measurements(measurements, config=config, device_kind=device_kind, source=source)
    try:
        table.save(args.out)
    except ValueError as error:  # the file changed since the check (a directory made there, say)
        raise CommandError(f"--out: {error}") from None
    print(format_bench_table(measurements, config, device=devices[0]))
    warnings = noise_warnings(measurements)
    if warnings:
        print()
        print("\n".join(warnings))
    print(f"\nselection table ({args.out}):")
    for token_range in table.ranges:
        print(f"  T in {token_range}")
    print(f"  T > {max(tokens)} is extrapolated: no larger T was measured, so the last range's tier "
          f"({table.ranges[-1].tier.value}) is assumed there")
    print(f"use it with TailConfig(..., selection_policy=k3_tail.SelectionTable.load({args.out!r}))")
    return 0


def noise_warnings(measurements: Sequence[Measurement]) -> list[str]:
    """A warning for each token count whose winner is within the noise of the runs: its q25-q75 range
    overlaps the runner-up's, so the runs cannot tell the two apart."""
    warnings = []
    for num_tokens in sorted({m.num_tokens for m in measurements}):
        ranked = sorted((m for m in measurements if m.num_tokens == num_tokens), key=lambda m: m.timing.median_s)
        if len(ranked) > 1 and within_noise(ranked[0].timing, ranked[1].timing):
            winner, runner_up = ranked[:2]
            warnings.append(
                f"warning: T={num_tokens}: {winner.tier.value} wins by "
                f"{format_percent(runner_up.timing.median_s / winner.timing.median_s - 1)} "
                f"({format_seconds(winner.timing.median_s)} vs {runner_up.tier.value}'s "
                f"{format_seconds(runner_up.timing.median_s)}), within the noise of the runs (their q25-q75 ranges "
                "overlap): more --repeats may pick the other")
    return warnings
