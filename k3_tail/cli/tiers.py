"""``k3-tail tiers``: the tiers the library has, from the registry (:mod:`k3_tail.tiers.registry`).

Prints :func:`k3_tail.tiers.registry.tier_table`, the Markdown table of the tiers (schedule,
per-rank GEMM FLOPs and kernel bytes, collectives, what each needs), which is also the README's
tier table. ``--json`` prints the records as plain data instead: a list in the registry's order,
one object per tier with its name, summary, schedule, collectives_text, needs_whole_kernel,
needs_unreduced_routed, projects_all_columns, token_sharded_form, shared_reduced_form and
compiler_options (per platform family). Needs no devices; exit status 0.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from k3_tail.tiers.record import TierRecord
from k3_tail.tiers.registry import TIER_RECORDS, tier_table

# The record's fields that are plain data, in the order --json writes them.
RECORD_FIELDS = (
    "name", "summary", "schedule", "collectives_text", "needs_whole_kernel", "needs_unreduced_routed",
    "projects_all_columns", "token_sharded_form", "shared_reduced_form",
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``tiers``: the tier table, or the tier records as JSON."""
    tiers = commands.add_parser(
        "tiers",
        help="list the tiers: schedule, cost and collectives per rank, what each needs",
        description="Print the tiers as a Markdown table (schedule, per-rank GEMM FLOPs and kernel bytes, "
        "collectives, what each needs), or with --json each tier's record as plain data.",
    )
    tiers.add_argument("--json", action="store_true", help="print the tier records as JSON")
    tiers.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """The ``tiers`` command: print the table or the records."""
    if args.json:
        print(json.dumps([record_dict(record) for record in TIER_RECORDS], indent=2))
    else:
        print(tier_table())
    return 0


def record_dict(record: TierRecord) -> dict[str, Any]:
    """``record``'s plain-data fields (:data:`RECORD_FIELDS`), with its compiler options as plain dicts."""
    options = {family: dict(values) for family, values in record.compiler_options.items()}
    return {**{name: getattr(record, name) for name in RECORD_FIELDS}, "compiler_options": options}
