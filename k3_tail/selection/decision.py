"""A choice of tier with the reason for it: what every selection policy returns."""

from __future__ import annotations

import dataclasses

from k3_tail.tiers.registry import Tier


@dataclasses.dataclass(frozen=True)
class TierDecision:
    """The tier chosen for one (config, token count, TP size), with the human-readable reason."""

    tier: Tier
    reason: str

    def __str__(self) -> str:
        return f"{self.tier.value}: {self.reason}"
