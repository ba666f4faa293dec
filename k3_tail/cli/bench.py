"""``k3-tail bench``: time every tier over token counts x TP sizes.

Times :func:`k3_tail.tail_forward` for every token count x tier x TP size with
:func:`k3_tail.tools.benchmark.measure_tiers` (Kimi-K3 shapes or any TailConfig by flags) and
prints the median, the quartiles and the speedup over native of each; ``--json``, ``--csv`` and
``--plot`` (log-log time vs T, :mod:`k3_tail.tools.plotting`) write them out. TP size p runs on the
first p devices of the command's device set (all GPUs, or ``--devices`` CPU devices). Default token
counts: 1, 2, 4, ... 8192, on the CPU backend up to 1024 (:data:`k3_tail.tools.benchmark.CPU_MAX_TOKENS`
says why). Each (p, T, tier) runs ``--warmup`` times (the first compiles), then ``--repeats`` timed
runs. Where the selection the table marks is vLLM's GPU thresholds on devices that are no GPUs, one
line before the table says so and how to calibrate. Every argument is checked before anything is
measured; a bad one is a one-line error (exit status 2).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys

import jax

from k3_tail.cli.harness import CommandError, check_output_flag, demo_devices, positive_int_list, tp_mesh
from k3_tail.cli.measurement import (
    add_measurement_arguments,
    measure,
    measurement_config,
    measurement_tiers,
    untimed_tiers,
)
from k3_tail.cli.tables import describe_config, format_bench_table, selected_tiers
from k3_tail.hardware import device_platform
from k3_tail.output_files import write_file
from k3_tail.selection.rules import gpu_rules_note
from k3_tail.tools.benchmark import Measurement, config_dict, default_token_counts, machine_info

HELP = "time the tiers over token counts x TP sizes; table, JSON, CSV, plot"
DESCRIPTION = (
    "Time tail_forward for every token count x tier x TP size on this machine's mesh (forced CPU devices without a "
    "GPU): warm-up runs, then repeated timed runs; print the median and quartiles of each and its speedup over the "
    "native tier. Kimi-K3 shapes unless the config flags say otherwise."
)


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """``bench``'s flags: the TP sizes, the measurement flags and the outputs."""
    bench.add_argument(
        "--tp-sizes", type=positive_int_list, metavar="P,P,...",
        help="TP sizes, comma-separated; size p runs on the first p devices (default: all devices)",
    )
    add_measurement_arguments(bench)
    outputs = bench.add_argument_group("output (the table goes to stdout, or to stderr when stdout carries - below)")
    outputs.add_argument("--json", metavar="FILE", help="write the machine, config, settings and measurements as "
                         "JSON to FILE ('-': stdout)")
    outputs.add_argument("--csv", metavar="FILE", help="write one row per measurement to FILE ('-': stdout)")
    outputs.add_argument("--plot", metavar="FILE.png", help="draw median time vs T, log-log, one line per tier and "
                         "one subplot per TP size, into a PNG (needs matplotlib: the [plot] extra)")


def run(args: argparse.Namespace) -> int:
    """The ``bench`` command: check every argument, measure, then print the table and write the outputs."""
    config = measurement_config(args)
    check_outputs(args)
    devices = demo_devices(args.devices)
    tiers = measurement_tiers(args.tiers, args.weight_layout, config, device_platform(devices[0]))
    tp_sizes = tuple(dict.fromkeys(args.tp_sizes or (len(devices),)))
    too_large = [p for p in tp_sizes if p > len(devices)]
    if too_large:
        flag = "--devices" if devices[0].platform == "cpu" else "the accelerators"
        raise CommandError(f"--tp-sizes: {too_large[0]} is more than the {len(devices)} devices ({flag})")
    platform = devices[0].platform
    tokens = args.tokens or default_token_counts(platform)
    table_stream = sys.stderr if "-" in (args.json, args.csv) else sys.stdout

    def say(line: str = "") -> None:
        print(line, file=table_stream, flush=True)

    say(f"jax {jax.__version__}, backend {jax.default_backend()}, {len(devices)} {platform} devices")
    say(f"config: {describe_config(config)}; kernel layout {args.weight_layout}")
    trimmed = f" (the {platform} default; --tokens for more)" if args.tokens is None and platform == "cpu" else ""
    say(f"T in {','.join(map(str, tokens))}{trimmed}; p in {','.join(map(str, tp_sizes))}; "
        f"tiers {', '.join(tier.value for tier in tiers)}")
    say(f"runs: {args.warmup} warm-up + {args.repeats} timed per (p, T, tier); seed {args.seed}")
    gpu_rules = gpu_rules_note(config, device_platform(devices[0]))
    if gpu_rules is not None:  # of the selection the table marks (*), said once
        say(f"selection (*): {gpu_rules}")
    if args.tiers is None:
        for reason in untimed_tiers(config, args.weight_layout, device_platform(devices[0])):
            say(f"not run: {reason}")
    say()

    measurements = measure(args, config, tiers, tokens, [tp_mesh(devices[:tp_size]) for tp_size in tp_sizes])

    say(format_bench_table(measurements, config, device=devices[0]))
    if args.json:
        document = {
            "machine": machine_info(), "config": config_dict(config),
            "settings": {
                "tokens": list(tokens), "tiers": [tier.value for tier in tiers], "tp_sizes": list(tp_sizes),
                "weight_layout": args.weight_layout, "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
            },
            "measurements": [m.to_dict() for m in measurements],
        }
        write_output("--json", args.json, json.dumps(document, indent=2) + "\n")
    if args.csv:
        table = io.StringIO(newline="")
        writer = csv.DictWriter(table, fieldnames=Measurement.field_names())
        writer.writeheader()
        writer.writerows(m.to_dict() for m in measurements)
        write_output("--csv", args.csv, table.getvalue())
    if args.plot:
        from k3_tail.tools.plotting import plot_measurements  # imports matplotlib: only when asked to plot

        title = f"{describe_config(config)}; kernel {args.weight_layout}; {platform}"
        selected = {key: decision.tier for key, decision in
                    selected_tiers(measurements, config, device=devices[0]).items()}
        image = io.BytesIO()
        plot_measurements(measurements, image, title=title, selected=selected)
        write_output("--plot", args.plot, image.getvalue())
        say(f"plot: {args.plot}")
    return 0


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before measuring, not after: at most one output on stdout, every output a file that can be
    written (:func:`k3_tail.output_files.check_output_file`: its directory present, no directory, FIFO,
    device or /proc file), matplotlib importable for --plot."""
    if args.json == "-" and args.csv == "-":
        raise CommandError("--json - and --csv -: only one of them can go to stdout")
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path and not (path == "-" and flag != "--plot"):
            check_output_flag(f"{flag} {path}", path)
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (only to know that plot_measurements can draw)
        except ImportError:
            raise CommandError("--plot needs matplotlib: pip install 'k3_tail[plot]'") from None


def write_output(flag: str, path: str, data: str | bytes) -> None:
    """Text ``data`` to stdout for "-" (flushed), else ``data`` written whole to the file ``path``
    (:func:`k3_tail.output_files.write_file`: --plot's "-" is a file of that name, as before); CommandError
    naming ``flag`` when that fails."""
    if path == "-" and isinstance(data, str):
        sys.stdout.write(data)
        sys.stdout.flush()
        return
    try:
        write_file(flag, path, data)
    except ValueError as error:
        raise CommandError(str(error)) from None
