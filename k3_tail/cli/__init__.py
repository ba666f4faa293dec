"""The command line: ``k3-tail COMMAND`` (or ``python -m k3_tail COMMAND``), one module per command.

Commands:
  demo       every tier on Kimi-K3 shapes, checked against native and timed (:mod:`k3_tail.cli.demo`)
  hlo        compile tail calls (one, or a sweep over tiers, layouts, kernels, sums, T, topologies) and report
             their cost, collectives and overlap (:mod:`k3_tail.cli.hlo`)
  bench      time the tiers over token counts x TP sizes; table, JSON, CSV, plot (:mod:`k3_tail.cli.bench`)
  calibrate  measure the tiers and write a selection table for ``TailConfig.selection_policy``
             (:mod:`k3_tail.cli.calibrate`)
  tiers      the tier table (terminal-wide, or Markdown), or the tier records as JSON (:mod:`k3_tail.cli.tiers`)

Each command module (:data:`COMMANDS`) has ``HELP`` and ``DESCRIPTION`` (its lines in
``--help``), ``add_arguments(parser)``, which declares its flags, and ``run(args)``, which takes the
parsed arguments and returns the exit status; a :class:`~k3_tail.tools.experiment.CommandError` is
reported in one line with exit status 2. What the commands share is the harness
(:mod:`k3_tail.tools.experiment`: argument types, devices, progress; :mod:`k3_tail.tools.tables`: figures
and tables) and :mod:`k3_tail.cli.common` (the measurement flags and what their tables say).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from k3_tail.cli import bench, calibrate, demo, hlo, tiers
from k3_tail.cli.common import PROG
from k3_tail.tools.experiment import CommandError, use_cpu_without_gpu

COMMANDS = {"demo": demo, "hlo": hlo, "bench": bench, "calibrate": calibrate, "tiers": tiers}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the chosen command, return its exit status."""
    args = build_parser().parse_args(argv)
    use_cpu_without_gpu()  # before anything starts JAX's backend
    try:
        return args.run(args)
    except CommandError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subparser per command of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="The Kimi-K3 latent MoE tail under tensor parallelism, in JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        subparser = commands.add_parser(name, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(subparser)
        subparser.set_defaults(run=command.run)
    return parser
