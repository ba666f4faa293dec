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
parsed arguments and returns the exit status; a :class:`~k3_tail.cli.harness.CommandError` is
reported in one line with exit status 2, and a closed stdout (``k3-tail tiers | head -1``) ends a
command quietly with status 141, as it ends ``git log``. What the commands share is the harness, which the
Kimi-K3 model's commands and the experiments in scripts/ use too: :mod:`k3_tail.cli.harness` (argument
types and flags, devices, progress, errors), :mod:`k3_tail.cli.tables` (figures and tables) and
:mod:`k3_tail.cli.measurement` (the measurement flags and run of ``bench`` and ``calibrate``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from k3_tail.cli import bench, calibrate, demo, hlo, tiers
from k3_tail.cli.harness import PROG, CommandError, HelpFormatter, use_cpu_without_gpu

COMMANDS = {"demo": demo, "hlo": hlo, "bench": bench, "calibrate": calibrate, "tiers": tiers}


# The exit status of a command whose reader closed its output early (``k3-tail tiers | head -1``): 128 + SIGPIPE,
# what a shell reports for ``git log | head``, whose writer the signal ends.
CLOSED_PIPE_STATUS = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the chosen command, return its exit status.

    A reader that closes stdout early ends the command quietly with :data:`CLOSED_PIPE_STATUS`: stdout is
    flushed here, where the BrokenPipeError is caught, and then pointed at /dev/null, so that the
    interpreter's flush at exit meets no closed pipe either (as the Python docs on SIGPIPE advise).
    """
    try:
        try:
            status = run_command(argv)
        except SystemExit:
            sys.stdout.flush()  # after --help, whose SystemExit passes through
            raise
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return CLOSED_PIPE_STATUS


def run_command(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run its command; a CommandError is one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    use_cpu_without_gpu()  # before anything starts JAX's backend
    try:
        return args.run(args)
    except CommandError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subparser per command of :data:`COMMANDS`, their help wrapped to the
    terminal (:class:`~k3_tail.cli.harness.HelpFormatter`)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="The Kimi-K3 latent MoE tail under tensor parallelism, in JAX.",
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        subparser = commands.add_parser(name, help=command.HELP, description=command.DESCRIPTION,
                                        formatter_class=HelpFormatter)
        command.add_arguments(subparser)
        subparser.set_defaults(run=command.run)
    return parser
