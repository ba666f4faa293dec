"""What a selection policy is: the base class of the value of ``TailConfig.selection_policy``.

Defined below the config, which holds a policy and checks it is one; the policies themselves build on
the tiers and live in :mod:`k3_tail.selection`: the vLLM rules (``rules.VllmRules``), a measured
:class:`~k3_tail.SelectionTable` and the cost model on a hardware preset (``cost_model.CostModelPolicy``).
"""

from __future__ import annotations

import abc
from typing import Any


class SelectionPolicy(abc.ABC):
    """Picks the tier for a call that :func:`k3_tail.select_tier` has found able to use a fast tier
    (p > 1, shared partials, an unreduced routed output, T > 0); select_tier checks the arguments
    and adds the notes on the call to the :class:`~k3_tail.TierDecision` that ``select`` returns."""

    @abc.abstractmethod
    def select(self, config: Any, num_tokens: int, tp_size: int, *, weight_layout: str | None = None,
               device_kind: str | None = None, platform: Any = None) -> Any:
        """The TierDecision for ``config`` (a TailConfig) at T = ``num_tokens`` on ``tp_size`` ranks, with
        the call's kernel layout, device kind and platform where known (None: not known; the platform as
        :func:`k3_tail.select_tier` takes it: a name of ``k3_tail.hardware.PLATFORMS`` or a ``jax.Device``,
        checked by :func:`k3_tail.hardware.check_platform`)."""
