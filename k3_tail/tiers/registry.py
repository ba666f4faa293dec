"""The ordered registry of tiers: the only list of them, and the :class:`Tier` enum that names them.

Adding a tier: its module under ``k3_tail/tiers/``, one entry below, its member in :class:`Tier`. The order
breaks ties between equally fast tiers in the cost model.
"""

from __future__ import annotations

import enum
from types import MappingProxyType

from k3_tail.config import TailConfig
from k3_tail.tiers import column_parallel, native, one_kernel, one_shot, overlap, scatter_gather, token_parallel
from k3_tail.tiers.record import TierRecord

TIER_RECORDS: tuple[TierRecord, ...] = (
    native.RECORD,
    overlap.RECORD,
    column_parallel.RECORD,
    scatter_gather.RECORD,
    one_shot.RECORD,
    token_parallel.RECORD,
    one_kernel.RECORD,
)
_BY_NAME = MappingProxyType({record.name: record for record in TIER_RECORDS})


class Tier(str, enum.Enum):
    """The schedules of the tail, in the registry's order; all compute the same function. A member's value is its
    record's name (``Tier.OVERLAP == "overlap"``); they are spelled out for type checkers (checked below)."""

    NATIVE = native.RECORD.name
    OVERLAP = overlap.RECORD.name
    COLUMN_PARALLEL = column_parallel.RECORD.name
    SCATTER_GATHER = scatter_gather.RECORD.name
    ONE_SHOT = one_shot.RECORD.name
    TOKEN_PARALLEL = token_parallel.RECORD.name
    ONE_KERNEL = one_kernel.RECORD.name

    @property
    def record(self) -> TierRecord:
        return _BY_NAME[self.value]

    def supports(self, weight_layout: str, config: TailConfig | None = None) -> bool:
        """Whether the tier runs with ``weight_layout`` ("column" or "replicated") and ``config``."""
        return self.record.why_not(weight_layout, config) is None

    def why_not(self, weight_layout: str, config: TailConfig | None = None) -> str | None:
        """Why the tier cannot run with ``weight_layout`` and ``config`` (None: not considered), or None."""
        return self.record.why_not(weight_layout, config)

    @classmethod
    def parse(cls, value: Tier | str, *, argument: str = "tier") -> Tier:
        """``value`` as a Tier; a string may be the value ("overlap") or the name ("OVERLAP").

        Raises:
          ValueError: naming ``argument``, for anything else.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for tier in cls:
                if value in (tier.value, tier.name):
                    return tier
        choices = ", ".join(repr(t.value) for t in cls)
        raise ValueError(f"{argument}: expected a k3_tail.Tier or one of {choices}, got {value!r}")


if [tier.value for tier in Tier] != [record.name for record in TIER_RECORDS]:
    raise ImportError("k3_tail.tiers.registry: the Tier members must be the registry's records, in its order")


TIER_TABLE_HEADER = ("tier", "what it is", "schedule", "GEMM FLOPs", "kernel bytes (FP8 kernel: half, + 4 per column)",
                     "collectives", "with the shared output reduced before the tail", "needs")


def tier_table() -> str:
    """The tiers as a Markdown table (:func:`tier_rows`). The README's tier table is this text."""
    lines = ["| " + " | ".join(TIER_TABLE_HEADER) + " |", "| " + " | ".join("---" for _ in TIER_TABLE_HEADER) + " |"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |" for cells in tier_rows()]
    return "\n".join(lines)


def tier_rows() -> list[tuple[str, ...]]:
    """One row of cells (:data:`TIER_TABLE_HEADER`) per tier (T tokens, p ranks, L -> H, bf16)."""
    rows = []
    for record in TIER_RECORDS:
        gemm = "2TLH/p" if record.splits_tokens or not record.projects_all_columns else "2TLH"
        kernel = "2LH" if record.projects_all_columns else "2LH/p"
        if record.projects_all_columns and not record.needs_whole_kernel:
            gemm, kernel = f"{gemm} (column layout: 2TLH/p)", f"{kernel} (column layout: 2LH/p)"
        needs = [text for flag, text in ((record.needs_whole_kernel, "replicated kernel"),
                                         (not record.serves_routed_output_is_reduced, "unreduced routed partials"))
                 if flag]
        rows.append((record.name, record.prose.summary, record.prose.schedule, gemm, kernel,
                     record.prose.collectives_text, record.prose.shared_reduced_form, ", ".join(needs) or "-"))
    return rows
