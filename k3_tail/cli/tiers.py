"""``k3-tail tiers``: the tiers the library has, from the registry (:mod:`k3_tail.tiers.registry`).

Prints the tier table (schedule, per-rank GEMM FLOPs and kernel bytes, collectives, what each
needs) laid out for the terminal: as wide as it is, long cells wrapped
(:func:`k3_tail.cli.tables.format_table`). ``--markdown`` prints it as
:func:`k3_tail.tiers.registry.tier_table` writes it, the README's tier table. ``--json`` prints the
records as plain data instead: a list in the registry's order,
one object per tier with its name, summary, schedule, collectives_text, needs_whole_kernel,
serves_routed_output_is_reduced, projects_all_columns, token_sharded_form, shared_reduced_form and
compiler_options (per platform family). Needs no devices; exit status 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import operator
from typing import Any

from k3_tail.cli.tables import format_table, terminal_width
from k3_tail.tiers.record import TierRecord
from k3_tail.tiers.registry import TIER_RECORDS, TIER_TABLE_HEADER, tier_rows, tier_table

HELP = "list the tiers: schedule, cost and collectives per rank, what each needs"
DESCRIPTION = (
    "Print the tiers as a table as wide as the terminal (schedule, per-rank GEMM FLOPs and kernel bytes, "
    "collectives, what each needs), as Markdown with --markdown, or with --json each tier's record as plain data."
)

# The record's flags that --json writes beside its name and prose (record.prose), and the order it writes them in.
RECORD_FLAGS = ("name", "needs_whole_kernel", "serves_routed_output_is_reduced", "projects_all_columns")
RECORD_FIELDS = (
    "name", "summary", "schedule", "collectives_text", "needs_whole_kernel", "serves_routed_output_is_reduced",
    "projects_all_columns", "token_sharded_form", "shared_reduced_form",
)


def add_arguments(tiers: argparse.ArgumentParser) -> None:
    """``tiers``' flags: the table as Markdown, or the records as JSON."""
    output = tiers.add_mutually_exclusive_group()
    output.add_argument("--markdown", action="store_true", help="print the table as Markdown (the README's)")
    output.add_argument("--json", action="store_true", help="print the tier records as JSON")


def run(args: argparse.Namespace) -> int:
    """The ``tiers`` command: print the table (for the terminal or as Markdown) or the records."""
    if args.json:
        print(json.dumps([record_dict(record) for record in TIER_RECORDS], indent=2))
    elif args.markdown:
        print(tier_table())
    else:
        columns = [(title, "<", operator.itemgetter(index)) for index, title in enumerate(TIER_TABLE_HEADER)]
        print(format_table(tier_rows(), columns, fit=True, width=terminal_width()))
    return 0


def record_dict(record: TierRecord) -> dict[str, Any]:
    """``record``'s plain data (:data:`RECORD_FIELDS`), with its compiler options as plain dicts."""
    options = {family: dict(values) for family, values in record.compiler_options.items()}
    values = {**dataclasses.asdict(record.prose), **{name: getattr(record, name) for name in RECORD_FLAGS}}
    return {**{name: values[name] for name in RECORD_FIELDS}, "compiler_options": options}
