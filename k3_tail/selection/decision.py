"""A choice of tier with the reason for it: what every selection policy returns."""

from __future__ import annotations

import dataclasses

from k3_tail.tiers.registry import Tier


@dataclasses.dataclass(frozen=True)
class TierDecision:
    """The tier chosen for one call: ``rule``, why, in one clause; ``notes``, further facts where they apply."""

    tier: Tier
    rule: str
    notes: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """The rule and the notes, in words: "rule; note; note"."""
        return "; ".join((self.rule, *self.notes))

    def __str__(self) -> str:
        return f"{self.tier.value}: {self.reason}"
