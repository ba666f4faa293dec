"""What a selection policy is: the base class of ``TailConfig.selection_policy``, below the config that checks it;
the policies live in :mod:`k3_tail.selection`."""

from __future__ import annotations

import abc
from typing import Any


class SelectionPolicy(abc.ABC):
    """Picks the tier for a call that :func:`k3_tail.select_tier` has checked and found able to use a fast tier."""

    @abc.abstractmethod
    def select(self, config: Any, num_tokens: int, tp_size: int, *, weight_layout: str | None = None,
               device_kind: str | None = None, platform: Any = None) -> Any:
        """The TierDecision for ``config`` at T = ``num_tokens`` on ``tp_size`` ranks; the rest as
        :func:`k3_tail.select_tier` takes it (None: not known)."""
