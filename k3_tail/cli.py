"""The command line: ``k3-tail COMMAND`` (or ``python -m k3_tail COMMAND``).

Commands:
  demo  Run the Kimi-K3 tail (H=7168, L=3584, bf16) on a TP mesh for a few token counts, on every
        tier, and print a table: for each token count T the tier :func:`k3_tail.select_tier` picks
        and why, and for each tier its error against the native tier and its median run time.
  hlo   Compile one tail call (Kimi-K3 shapes) for a deviceless GPU topology (``h100x8``, ...), a
        CPU mesh or this machine's accelerators, and print :mod:`k3_tail.xla_report`'s report:
        per-device cost, every collective, and whether the shared reduction overlaps the GEMM.
  bench Time every tier for token counts x TP sizes (:mod:`k3_tail.benchmark`; Kimi-K3 shapes or
        any TailConfig by flags) and print the median, the quartiles and the speedup over native of
        each; ``--json``, ``--csv`` and ``--plot`` (log-log time vs T) write them out. TP size p runs
        on the first p devices of that device set (below). Default token counts: 1, 2, 4, ... 8192,
        on the CPU backend up to 1024 (:data:`k3_tail.benchmark.CPU_MAX_TOKENS` says why).
  calibrate  Measure the tiers as bench does, on one TP size, and write the fastest tier per token
        range as a JSON selection table (:mod:`k3_tail.calibration`) for
        ``TailConfig(selection_policy="measured")``.

The demo, bench and calibrate build their own mesh: with an accelerator backend (GPU) they use all of that
backend's devices; otherwise they ask JAX for ``--devices`` CPU devices (8 by default), which must
happen before JAX initialises its backend, so they do it first. Inputs are random with a fixed
seed and are placed on the mesh once, the weights before the first token count and each T's
partials before its runs, so the times measure the tail, not host transfers. Each (T, tier) runs
once to compile (the warm-up; bench: ``--warmup`` times), then ``--repeats`` timed runs. The demo's
exit status is 1 when some tier is further than ``RELATIVE_ERROR_TOLERANCE`` from native (relative
Frobenius error), 0 otherwise.

Each command is a subparser whose ``run`` default takes the parsed arguments and returns the exit
status; a :class:`CommandError` is reported in one line with exit status 2.

On a machine without a GPU, with a GPU plugin installed (the ``[aot]`` extra), JAX would print the
plugin's failed start-up (a cuDNN traceback) before falling back to the CPU. ``main`` therefore
selects the CPU platform itself when neither ``JAX_PLATFORMS`` is set nor a GPU device node
(``/dev/nvidiactl`` for CUDA, ``/dev/kfd`` for ROCm) exists.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO

import jax
import numpy as np
from jax.sharding import Mesh

from k3_tail import xla_report
from k3_tail.benchmark import (
    CPU_MAX_TOKENS, DEFAULT_MAX_TOKENS, Measurement, check_tiers, config_dict, default_token_counts, machine_info,
    measure_tiers, place_partials, place_weights, plot_measurements, tiers_for, time_runs,
)
from k3_tail.calibration import table_from_measurements
from k3_tail.columns import WEIGHT_LAYOUTS
from k3_tail.compilation import compile_tail, compiler_options
from k3_tail.config import TailConfig
from k3_tail.forward import tail_forward
from k3_tail.selection import Tier, TierDecision, select_tier
from k3_tail.topologies import TopologyUnavailable, topology_mesh

PROG = "k3-tail"
AXIS_NAME = "tp"

DEFAULT_TOKEN_COUNTS = (1, 16, 64, 320)
DEFAULT_REPEATS = 5
DEFAULT_CPU_DEVICES = 8
DEFAULT_SEED = 0
# bf16 keeps 8 significand bits: tiers that sum and round in another order differ by a few 1e-3.
RELATIVE_ERROR_TOLERANCE = 1e-2
DEFAULT_HLO_TOKENS = 16
CONFIG_DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_TOPOLOGY = "h100x8"
# Device nodes whose presence means a GPU backend can start (CUDA, ROCm).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


class CommandError(Exception):
    """A failure to report to the user in one line (no traceback); ``main`` returns 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the chosen command, return its exit status."""
    args = build_parser().parse_args(argv)
    use_cpu_without_gpu()
    try:
        return args.run(args)
    except CommandError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subparser per command."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="The Kimi-K3 latent MoE tail under tensor parallelism, in JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_command(commands)
    add_hlo_command(commands)
    add_bench_command(commands)
    add_calibrate_command(commands)
    return parser


def use_cpu_without_gpu() -> None:
    """Select JAX's CPU platform when the user chose none and no GPU device node exists.

    Keeps a GPU plugin that cannot start from printing its traceback (module docstring). Does
    nothing once JAX's backends are up, or when ``JAX_PLATFORMS`` / ``jax_platforms`` is set.
    """
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass  # the backend is already initialised: nothing left to protect


def add_demo_command(commands: argparse._SubParsersAction) -> None:
    """Register ``demo``: every tier on Kimi-K3 shapes, checked against native and timed."""
    demo = commands.add_parser(
        "demo",
        help="run every tier on Kimi-K3 shapes, check it against native, time it",
        description="Run the Kimi-K3 tail (H=7168, L=3584, bf16) on every tier for a few token counts; "
        "print the tier select_tier picks and why, each tier's error against native and its median time.",
    )
    demo.add_argument(
        "--tokens", type=positive_int_list, default=DEFAULT_TOKEN_COUNTS, metavar="T,T,...",
        help=f"token counts to run, comma-separated (default: {','.join(map(str, DEFAULT_TOKEN_COUNTS))})",
    )
    demo.add_argument(
        "--repeats", type=positive_int, default=DEFAULT_REPEATS, metavar="N",
        help=f"timed runs per (T, tier) after the warm-up run (default: {DEFAULT_REPEATS})",
    )
    demo.add_argument(
        "--devices", type=positive_int, default=DEFAULT_CPU_DEVICES, metavar="N",
        help=f"CPU devices to make, the TP size without an accelerator (default: {DEFAULT_CPU_DEVICES}); "
        "with a GPU all GPUs are used",
    )
    demo.add_argument(
        "--weight-layout", choices=WEIGHT_LAYOUTS, default="column",
        help="where the up-projection kernel lives: column-sharded or replicated (default: column)",
    )
    demo.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default: {DEFAULT_SEED})")
    demo.set_defaults(run=run_demo)


def add_hlo_command(commands: argparse._SubParsersAction) -> None:
    """Register ``hlo``: the XLA report of one compiled tail call."""
    hlo = commands.add_parser(
        "hlo",
        help="compile one tail call and report its cost, collectives and overlap",
        description="Compile one Kimi-K3 tail call for a deviceless GPU topology (no GPU needed), a CPU mesh or "
        "this machine's accelerators, and print per-device FLOPs and bytes, every collective (kind, shape, bytes, "
        "async or not, what is scheduled inside it) and whether the shared reduction overlaps the GEMM.",
    )
    hlo.add_argument(
        "--tier", choices=["auto", *(tier.value for tier in Tier)], default="auto",
        help="tier to compile; auto: what select_tier picks for --tokens (default: auto)",
    )
    hlo.add_argument(
        "--tokens", type=non_negative_int, default=DEFAULT_HLO_TOKENS, metavar="T",
        help=f"token count T (default: {DEFAULT_HLO_TOKENS})",
    )
    hlo.add_argument(
        "--topology", default=DEFAULT_TOPOLOGY, metavar="NAME",
        help=f"h100x8, h200x8, mi300xx8, mi355xx8 (<target>x<count>, deviceless), cpu (--devices CPU devices) or "
        f"local (this machine's accelerators) (default: {DEFAULT_TOPOLOGY})",
    )
    hlo.add_argument(
        "--devices", type=positive_int, default=DEFAULT_CPU_DEVICES, metavar="N",
        help=f"CPU devices for --topology cpu (default: {DEFAULT_CPU_DEVICES})",
    )
    hlo.add_argument(
        "--weight-layout", choices=WEIGHT_LAYOUTS, default="column",
        help="where the up-projection kernel lives: column-sharded or replicated (default: column)",
    )
    hlo.add_argument("--json", action="store_true", help="print the report as JSON")
    hlo.set_defaults(run=run_hlo)


def run_hlo(args: argparse.Namespace) -> int:
    """The ``hlo`` command: compile, report, print (text or JSON)."""
    mesh = hlo_mesh(args.topology, args.devices)
    config = TailConfig.kimi_k3()
    tp_size = mesh.shape[AXIS_NAME]
    selection = select_tier(config, args.tokens, tp_size)
    tier = selection.tier if args.tier == "auto" else Tier.parse(args.tier)
    why = f"selected: {selection.reason}" if args.tier == "auto" else "forced by --tier"
    options = compiler_options(tier, mesh.devices.flat[0].platform)
    try:
        compiled = compile_tail(
            config, mesh, args.tokens, tier=tier, axis_name=AXIS_NAME, weight_layout=args.weight_layout
        )
    except ValueError as error:  # e.g. the one_shot tier with the column layout
        raise CommandError(str(error)) from None
    report = xla_report.report(compiled)
    if args.json:
        print(json.dumps({
            "topology": args.topology, "tier": tier.value, "tier_reason": why, "num_tokens": args.tokens,
            "tp_size": tp_size, "weight_layout": args.weight_layout, "compiler_options": options,
            "report": report.to_dict(),
        }, indent=2))
        return 0
    print(f"tier: {tier.value} ({why}); T={args.tokens}, p={tp_size}, kernel layout {args.weight_layout}")
    print(f"config: Kimi-K3 tail, H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}")
    print(f"topology: {args.topology}; compiler options: {options or 'none'}")
    print(report.format())
    return 0


def add_bench_command(commands: argparse._SubParsersAction) -> None:
    """Register ``bench``: time every tier over token counts x TP sizes (k3_tail.benchmark)."""
    bench = commands.add_parser(
        "bench",
        help="time the tiers over token counts x TP sizes; table, JSON, CSV, plot",
        description="Time tail_forward for every token count x tier x TP size on this machine's mesh (forced CPU "
        "devices without a GPU): warm-up runs, then repeated timed runs; print the median and quartiles of each and "
        "its speedup over the native tier. Kimi-K3 shapes unless the config flags say otherwise.",
    )
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
    bench.set_defaults(run=run_bench)


def add_measurement_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``bench`` and ``calibrate`` share: what to measure, how often, and the tail config."""
    kimi = TailConfig.kimi_k3()
    parser.add_argument(
        "--tokens", type=positive_int_list, metavar="T,T,...",
        help=f"token counts, comma-separated (default: 1, 2, 4, ... {DEFAULT_MAX_TOKENS}; on the CPU backend "
        f"up to {CPU_MAX_TOKENS})",
    )
    parser.add_argument(
        "--tiers", type=tier_list, metavar="TIER,...",
        help=f"tiers to time, comma-separated, of {', '.join(tier.value for tier in Tier)} "
        "(default: every tier that runs with --weight-layout)",
    )
    parser.add_argument(
        "--devices", type=positive_int, default=DEFAULT_CPU_DEVICES, metavar="N",
        help=f"CPU devices to make without an accelerator (default: {DEFAULT_CPU_DEVICES}); with a GPU all GPUs "
        "are used",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=DEFAULT_REPEATS, metavar="N",
        help=f"timed runs per (T, tier) and TP size (default: {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--warmup", type=positive_int, default=1, metavar="N",
        help="untimed runs before them, the first of which compiles (default: 1)",
    )
    parser.add_argument(
        "--weight-layout", choices=WEIGHT_LAYOUTS, default="column",
        help="where the up-projection kernel lives: column-sharded or replicated (default: column)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default: {DEFAULT_SEED})")
    shapes = parser.add_argument_group("tail config (default: Kimi-K3)")
    shapes.add_argument("--hidden-size", type=positive_int, default=kimi.hidden_size, metavar="H",
                        help=f"hidden size H (default: {kimi.hidden_size})")
    shapes.add_argument("--latent-size", type=positive_int, default=kimi.latent_size, metavar="L",
                        help=f"latent size L (default: {kimi.latent_size})")
    shapes.add_argument("--dtype", choices=CONFIG_DTYPES, default=kimi.dtype.name,
                        help=f"activation and weight dtype (default: {kimi.dtype.name})")
    shapes.add_argument("--eps", type=float, default=kimi.rms_norm_eps,
                        help=f"RMSNorm epsilon (default: {kimi.rms_norm_eps:g})")
    shapes.add_argument("--scale", type=float, default=kimi.routed_scaling_factor,
                        help=f"routed_scaling_factor (default: {kimi.routed_scaling_factor:g})")
    shapes.add_argument("--no-norm", action="store_true", help="no latent RMSNorm (use_latent_norm=False)")
    shapes.add_argument("--no-shared", action="store_true", help="no shared experts (has_shared_experts=False)")
    shapes.add_argument("--reduced-routed", action="store_true",
                        help="the routed output arrives reduced, [T, L] (fused_output_is_reduced=True)")
    shapes.add_argument("--sequence-parallel", action="store_true",
                        help="token-sharded output (sequence_parallel=True)")


def run_bench(args: argparse.Namespace) -> int:
    """The ``bench`` command: check every argument, measure, then print the table and write the outputs."""
    config = measurement_config(args)
    tiers = measurement_tiers(args.tiers, args.weight_layout, config)
    check_outputs(args)
    devices = demo_devices(args.devices)
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
    for tier in Tier if args.tiers is None else ():
        reason = tier.why_not(args.weight_layout, config)
        if reason is not None:
            say(f"not run: {reason}")
    say()

    bar = ProgressBar(len(tp_sizes) * len(tokens) * len(tiers))
    measurements = []
    for tp_size in tp_sizes:
        mesh = jax.make_mesh((tp_size,), (AXIS_NAME,), devices=devices[:tp_size])
        measurements += measure_tiers(
            config, mesh, tokens, tiers=tiers, weight_layout=args.weight_layout, repeats=args.repeats,
            warmup=args.warmup, axis_name=AXIS_NAME, seed=args.seed, on_progress=bar.step,
        )
    bar.finish()

    say(format_bench_table(measurements, config, device_kind=devices[0].device_kind))
    if args.json:
        document = {
            "machine": machine_info(), "config": config_dict(config),
            "settings": {
                "tokens": list(tokens), "tiers": [tier.value for tier in tiers], "tp_sizes": list(tp_sizes),
                "weight_layout": args.weight_layout, "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
            },
            "measurements": [m.to_dict() for m in measurements],
        }
        with output_stream(args.json) as stream:
            json.dump(document, stream, indent=2)
            stream.write("\n")
    if args.csv:
        with output_stream(args.csv) as stream:
            writer = csv.DictWriter(stream, fieldnames=[field.name for field in dataclasses.fields(Measurement)])
            writer.writeheader()
            writer.writerows(m.to_dict() for m in measurements)
    if args.plot:
        title = f"{describe_config(config)}; kernel {args.weight_layout}; {platform}"
        plot_measurements(measurements, args.plot, title=title)
        say(f"plot: {args.plot}")
    return 0


def add_calibrate_command(commands: argparse._SubParsersAction) -> None:
    """Register ``calibrate``: measure the tiers and write a selection table (k3_tail.calibration)."""
    calibrate = commands.add_parser(
        "calibrate",
        help="measure the tiers on this mesh and write a selection table (JSON) for selection_policy='measured'",
        description="Time every tier at each token count on this machine's mesh (forced CPU devices without a GPU), "
        "keep the fastest per T and write the token ranges -> tier table as JSON. Load it with "
        "TailConfig(selection_policy='measured', selection_table=SelectionTable.load(FILE)); it is valid for this "
        "device kind, TP size, kernel layout, shapes and dtype only.",
    )
    calibrate.add_argument("--out", required=True, metavar="FILE.json", help="where to write the table")
    calibrate.add_argument(
        "--tp-size", type=positive_int, metavar="P", help="TP size: the first P devices (default: all devices)"
    )
    add_measurement_arguments(calibrate)
    calibrate.set_defaults(run=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    """The ``calibrate`` command: measure, build the table, write it, print it."""
    config = measurement_config(args)
    tiers = measurement_tiers(args.tiers, args.weight_layout, config)
    directory = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(directory):
        raise CommandError(f"--out: directory {directory!r} does not exist")
    devices = demo_devices(args.devices)
    tp_size = args.tp_size or len(devices)
    if tp_size > len(devices):
        raise CommandError(f"--tp-size: {tp_size} is more than the {len(devices)} devices")
    mesh = jax.make_mesh((tp_size,), (AXIS_NAME,), devices=devices[:tp_size])
    tokens = args.tokens or default_token_counts(devices[0].platform)
    device_kind = devices[0].device_kind
    print(f"calibrating on p={tp_size} {device_kind} devices; config: {describe_config(config)}; "
          f"kernel layout {args.weight_layout}")
    print(f"T in {','.join(map(str, tokens))}; tiers {', '.join(t.value for t in tiers)}; "
          f"{args.warmup} warm-up + {args.repeats} timed runs each", flush=True)
    bar = ProgressBar(len(tokens) * len(tiers))
    measurements = measure_tiers(
        config, mesh, tokens, tiers=tiers, weight_layout=args.weight_layout, repeats=args.repeats,
        warmup=args.warmup, axis_name=AXIS_NAME, seed=args.seed, on_progress=bar.step,
    )
    bar.finish()
    source = (f"k3-tail calibrate, {time.strftime('%Y-%m-%d')}, jax {jax.__version__}, "
              f"T={','.join(map(str, tokens))}, {args.repeats} repeats")
    table = table_from_measurements(measurements, config=config, device_kind=device_kind, source=source)
    table.save(args.out)
    print(format_bench_table(measurements, config, device_kind=device_kind))
    print(f"\nselection table ({args.out}):")
    for token_range in table.ranges:
        print(f"  T in {token_range}")
    print("use it with TailConfig(..., selection_policy='measured', "
          f"selection_table=k3_tail.SelectionTable.load({args.out!r}))")
    return 0


def measurement_config(args: argparse.Namespace) -> TailConfig:
    """The TailConfig the config flags describe (CommandError when TailConfig rejects them)."""
    try:
        return TailConfig(
            hidden_size=args.hidden_size, latent_size=args.latent_size, dtype=args.dtype, rms_norm_eps=args.eps,
            routed_scaling_factor=args.scale, use_latent_norm=not args.no_norm, has_shared_experts=not args.no_shared,
            fused_output_is_reduced=args.reduced_routed, sequence_parallel=args.sequence_parallel,
        )
    except ValueError as error:
        raise CommandError(f"config: {error}") from None


def measurement_tiers(tiers: Sequence[Tier] | None, weight_layout: str, config: TailConfig) -> tuple[Tier, ...]:
    """The tiers to time (CommandError when one is repeated or cannot run with the layout or config)."""
    try:
        return check_tiers(tiers, weight_layout, config)
    except ValueError as error:  # its message starts with "tiers: "
        raise CommandError(f"--{error}") from None


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before measuring, not after: at most one output on stdout, every output file's directory
    present, matplotlib importable for --plot."""
    if args.json == "-" and args.csv == "-":
        raise CommandError("--json - and --csv -: only one of them can go to stdout")
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path and path != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise CommandError(f"{flag} {path}: no such directory")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (only to know that plot_measurements can draw)
        except ImportError:
            raise CommandError("--plot needs matplotlib: pip install 'k3_tail[plot]'") from None


@contextlib.contextmanager
def output_stream(path: str) -> Iterator[IO[str]]:
    """A text stream to write an output to: the file ``path``, closed afterwards, or stdout for "-"
    (flushed afterwards, left open)."""
    if path == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8", newline="") as stream:
        yield stream


def describe_config(config: TailConfig) -> str:
    """One line: the config's shapes and numerics, e.g. "H=7168, L=3584, bfloat16, eps 1e-06, scale 1"."""
    text = (f"H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}, eps {config.rms_norm_eps:g}, "
            f"scale {config.routed_scaling_factor:g}")
    flags = [name for name, on in (
        ("no norm", not config.use_latent_norm), ("no shared experts", not config.has_shared_experts),
        ("reduced routed output", config.fused_output_is_reduced), ("sequence-parallel", config.sequence_parallel),
    ) if on]
    return ", ".join([text, *flags])


def format_bench_table(measurements: Sequence[Measurement], config: TailConfig, *, device_kind: str) -> str:
    """The bench table: one row per (p, T, tier) with the median, the q25-q75 spread (ms) and the
    speedup over native at the same (p, T) (median over median; "-" when native was not timed).
    A "*" marks the tier select_tier picks for that call (``config``, T, p, layout, ``device_kind``)."""
    native = {(m.tp_size, m.num_tokens): m.median_s for m in measurements if m.tier == Tier.NATIVE}
    lines = [f"{'p':>4}{'T':>7}  {'tier':<16}{'median ms':>11}{'q25-q75 ms':>19}{'vs native':>11}"]
    previous = None
    for m in measurements:
        if previous is not None and (m.tp_size, m.num_tokens) != previous:
            lines.append("")
        previous = m.tp_size, m.num_tokens
        speedup = native.get(previous)
        speedup = "-" if speedup is None else f"{speedup / m.median_s:.2f}x"
        spread = f"{format_ms(m.q25_s)}-{format_ms(m.q75_s)}"
        selection = select_tier(config, m.num_tokens, m.tp_size, weight_layout=m.weight_layout,
                                device_kind=device_kind)
        selected = " *" if selection.tier == m.tier else ""
        lines.append(f"{m.tp_size:>4}{m.num_tokens:>7}  {m.tier.value:<16}{format_ms(m.median_s):>11}{spread:>19}"
                     f"{speedup:>11}{selected}")
    lines += ["", "* the tier select_tier picks for that call (config, T, p, layout, device kind)"]
    return "\n".join(lines)


def format_ms(seconds: float) -> str:
    """``seconds`` in milliseconds with about 3 significant digits (0.0123, 1.23, 123)."""
    milliseconds = 1e3 * seconds
    digits = next((d for d, bound in ((4, 0.1), (3, 1), (2, 10), (1, 100)) if milliseconds < bound), 0)
    return f"{milliseconds:.{digits}f}"


def tier_list(text: str) -> tuple[Tier, ...]:
    """A comma-separated list of tier values (argparse type)."""
    tiers = []
    for item in text.split(","):
        try:
            tiers.append(Tier.parse(item.strip()))
        except ValueError:
            choices = ", ".join(tier.value for tier in Tier)
            raise argparse.ArgumentTypeError(f"expected tiers among {choices}, got {item.strip()!r}") from None
    return tuple(tiers)


class ProgressBar:
    """A text progress bar on ``stream`` (default: stderr) over ``total`` steps, with the elapsed time.

    On a terminal it redraws one line in place; elsewhere (a pipe, a CI log) it writes one line per
    step instead, because carriage returns would pile up there as one garbled line.
    """

    WIDTH = 24

    def __init__(self, total: int, stream: IO[str] | None = None):
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.interactive = self.stream.isatty()
        self.done = 0
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        """A step named ``label`` starts (the previous one, if any, is done)."""
        self._draw(label)
        self.done += 1

    def finish(self) -> None:
        """Every step is done."""
        self.done = self.total
        self._draw("done")
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, label: str) -> None:
        filled = self.WIDTH * self.done // max(self.total, 1)
        text = (f"[{'#' * filled}{'-' * (self.WIDTH - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:.0f} s  {label}")
        # "\x1b[K" erases what a longer previous label left on the line.
        self.stream.write(f"\r{text}\x1b[K" if self.interactive else f"{text}\n")
        self.stream.flush()


def hlo_mesh(topology: str, cpu_device_count: int) -> Mesh:
    """The 1-d TP mesh to compile on: a deviceless topology, CPU devices or the local accelerators."""
    if topology == "cpu":
        devices = demo_devices(cpu_device_count, accelerators=False)
    elif topology == "local":
        devices = jax.devices()
    else:
        try:
            return topology_mesh(topology, axis_name=AXIS_NAME)
        except (ValueError, TopologyUnavailable) as error:
            raise CommandError(f"--topology: {error}") from None
    return jax.make_mesh((len(devices),), (AXIS_NAME,), devices=devices)


def positive_int(text: str) -> int:
    """``text`` as an integer >= 1 (argparse type)."""
    return bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    """``text`` as an integer >= 0 (argparse type)."""
    return bounded_int(text, 0)


def bounded_int(text: str, minimum: int) -> int:
    """``text`` as an integer >= ``minimum``, else argparse.ArgumentTypeError."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def positive_int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers, each >= 1 (argparse type): token counts, TP sizes."""
    return tuple(positive_int(item.strip()) for item in text.split(","))


def run_demo(args: argparse.Namespace) -> int:
    """The ``demo`` command: see the module docstring. Returns 1 when a tier disagrees with native."""
    devices = demo_devices(args.devices)
    mesh = jax.make_mesh((len(devices),), (AXIS_NAME,), devices=devices)
    tp_size = mesh.shape[AXIS_NAME]
    config = TailConfig.kimi_k3()
    rng = np.random.default_rng(args.seed)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices")
    print(f"mesh: {AXIS_NAME}={tp_size} over {len(devices)} {devices[0].platform} devices")
    print(
        f"config: Kimi-K3 tail, H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}, "
        f"overlap_token_threshold={config.overlap_token_threshold}; kernel layout {args.weight_layout}"
    )
    print(
        f"runs: 1 warm-up + {args.repeats} timed per (T, tier), T in {', '.join(map(str, args.tokens))}; "
        f"seed {args.seed}"
    )
    print(flush=True)

    tiers = tiers_for(args.weight_layout)
    skipped = [tier.value for tier in Tier if tier not in tiers]
    if skipped:
        print(f"not run with kernel layout {args.weight_layout}: {', '.join(skipped)} "
              "(needs --weight-layout replicated)")
    progress("placing the weights on the mesh")
    norm_weight, up_proj_kernel = place_weights(config, mesh, args.weight_layout, rng, axis_name=AXIS_NAME)
    rows = []
    for index, num_tokens in enumerate(args.tokens, start=1):
        routed_partials, shared_partials = place_partials(config, mesh, num_tokens, rng, axis_name=AXIS_NAME)
        forward = functools.partial(
            tail_forward, routed_partials, shared_partials, norm_weight, up_proj_kernel,
            config=config, mesh=mesh, axis_name=AXIS_NAME, weight_layout=args.weight_layout,
        )
        selection = select_tier(config, num_tokens, tp_size)
        label = f"T={num_tokens} ({index}/{len(args.tokens)})"
        rows += run_every_tier(forward, tiers, num_tokens, selection, args.repeats, label)

    print_table(rows)
    # `not <=` so that a NaN error fails too.
    failures = [row for row in rows if not row.relative_error <= RELATIVE_ERROR_TOLERANCE]
    print()
    if not failures:
        print(f"every tier agrees with native: relative error <= {RELATIVE_ERROR_TOLERANCE:g} for every T")
        return 0
    for row in failures:
        print(
            f"FAIL: T={row.num_tokens} {row.tier.value}: relative error {row.relative_error:.3e} "
            f"vs native exceeds {RELATIVE_ERROR_TOLERANCE:g}"
        )
    return 1


def demo_devices(cpu_device_count: int, *, accelerators: bool = True) -> list[jax.Device]:
    """The devices to build the TP mesh on: all accelerators (when ``accelerators`` and the default
    backend is one), else ``cpu_device_count`` CPU devices.

    Sets JAX's CPU device count before anything initialises the backend. When the backend is
    already up (``main`` called inside a program that has used JAX) the count can no longer change;
    its CPU devices are used if there are enough, otherwise CommandError.
    """
    try:
        jax.config.update("jax_num_cpu_devices", cpu_device_count)
    except RuntimeError:
        pass  # the backend is already initialised: checked against the count below
    if accelerators and jax.default_backend() != "cpu":
        return jax.devices()
    cpu_devices = jax.devices("cpu")
    if len(cpu_devices) < cpu_device_count:
        raise CommandError(
            f"--devices {cpu_device_count}: JAX's CPU backend was already initialised with {len(cpu_devices)} "
            "device(s); run the command in a fresh process"
        )
    return cpu_devices[:cpu_device_count]


@dataclasses.dataclass(frozen=True)
class TierRow:
    """One row of the demo's table: one tier at one token count, compared with the native tier."""

    num_tokens: int
    tier: Tier
    selection: TierDecision
    max_abs_error: float
    relative_error: float
    median_seconds: float


def run_every_tier(
    forward: Callable[..., jax.Array], tiers: Sequence[Tier], num_tokens: int, selection: TierDecision, repeats: int,
    label: str,
) -> list[TierRow]:
    """Time ``forward(tier=...)`` on each of ``tiers`` (native first) at one token count and compare
    each with native.

    ``selection`` is what :func:`select_tier` picks for this token count; ``label`` starts the
    progress lines.
    """
    timings = {}
    for tier in tiers:
        progress(f"{label} {tier.value}: ", end="")
        output, warmup_seconds, timing = time_runs(functools.partial(forward, tier=tier), repeats=repeats)
        timings[tier] = np.asarray(output, dtype=np.float32), timing.median_s
        progress(f"warm-up {warmup_seconds:.2f} s, median {1e3 * timing.median_s:.1f} ms")
    native_output, _ = timings[Tier.NATIVE]
    native_norm = np.linalg.norm(native_output)
    rows = []
    for tier, (output, median_seconds) in timings.items():
        difference = output - native_output
        rows.append(TierRow(
            num_tokens, tier, selection,
            max_abs_error=float(np.max(np.abs(difference))),
            relative_error=float(np.linalg.norm(difference) / native_norm),
            median_seconds=median_seconds,
        ))
    return rows


def print_table(rows: Sequence[TierRow]) -> None:
    """The demo's table, one block of rows per token count; the selected tier's row gives the reason."""
    print(f"{'T':>5}  {'tier':<16}{'max abs err':>12}{'rel err':>11}{'median ms':>11}  selected because")
    previous_tokens = None
    for row in rows:
        if previous_tokens is not None and row.num_tokens != previous_tokens:
            print()
        previous_tokens = row.num_tokens
        if row.tier == Tier.NATIVE:
            errors = f"{'reference':>12}{'':>11}"
        else:
            errors = f"{row.max_abs_error:>12.3e}{row.relative_error:>11.3e}"
        reason = f"  <- {row.selection.reason}" if row.selection.tier == row.tier else ""
        print(f"{row.num_tokens:>5}  {row.tier.value:<16}{errors}{1e3 * row.median_seconds:>11.1f}{reason}")


def progress(message: str, end: str = "\n") -> None:
    """``message`` to stderr at once, so a long run shows what it is doing."""
    print(message, end=end, file=sys.stderr, flush=True)
