"""The tier of a call for the platform its program is lowered for (``jax.export(platforms=...)``, ahead of time),
not the one that traces it: one branch per distinct program, joined by ``jax.lax.platform_dependent``; what
differs between the GPU vendors alone is decided as each lowers, so CUDA and ROCm share one traced branch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from jax import lax

from k3_tail.config import TailConfig
from k3_tail.hardware import GPU_VENDOR_PLATFORMS
from k3_tail.selection.buffers import collective_buffers
from k3_tail.selection.rules import choose_tier
from k3_tail.tiers.registry import Tier

# The platforms with a branch of their own; any other (a TPU) lowers the CPU's, as selection treats them alike.
LOWERING_PLATFORMS = ("cpu", *GPU_VENDOR_PLATFORMS)
_DEFAULT_PLATFORM = "cpu"


def per_lowering_platform(branches: Mapping[str, Hashable], run: Callable[..., Any], *operands: Any) -> Any:
    """``run(branches[platform], *operands)`` for the platform the program is lowered for; platforms with equal
    (hashable) descriptions in ``branches`` share one traced branch, and with one ``run`` is called directly."""
    distinct = {branch: functools.partial(run, branch) for branch in dict.fromkeys(branches.values())}
    if len(distinct) == 1:
        (only,) = distinct.values()
        return only(*operands)
    per_platform = {platform: distinct[branches[platform]] for platform in LOWERING_PLATFORMS}
    return lax.platform_dependent(*operands, default=per_platform[_DEFAULT_PLATFORM], **per_platform)


@dataclasses.dataclass(frozen=True)
class TailBranch:
    """The program of one call's tail on the platforms that share it: the tier, and the platform its steps are
    traced for (one platform's name, "gpu" for both GPU vendors, or None for every platform)."""

    tier: Tier
    platform: str | None


def tail_branches(config: TailConfig, num_tokens: int, tp_size: int, *, weight_layout: str,
                  tier: Tier | None) -> dict[str, TailBranch]:
    """The :class:`TailBranch` for each of :data:`LOWERING_PLATFORMS`: ``tier`` (checked) or that platform's choice."""
    programs = {}
    for platform in LOWERING_PLATFORMS:
        chosen = tier or choose_tier(config, num_tokens, tp_size, weight_layout=weight_layout,
                                     device_kind=None, platform=platform).tier
        programs[platform] = (chosen, _platform_facts(config, num_tokens, tp_size, chosen, weight_layout, platform))
    return {platform: TailBranch(program[0], _shared_platform([other for other in LOWERING_PLATFORMS
                                                              if programs[other] == program]))
            for platform, program in programs.items()}


def _shared_platform(platforms: list[str]) -> str | None:
    if len(platforms) == 1:
        return platforms[0]
    return "gpu" if set(platforms) == set(GPU_VENDOR_PLATFORMS) else None


def _platform_facts(config, num_tokens, tp_size, tier, weight_layout, platform) -> tuple:
    """What ``tier``'s steps read of ``platform``: whether its kernel compiles, how each collective travels."""
    record = tier.record
    compiled = None if record.own_kernel is None else not record.runs_interpreted_on(platform)
    buffers = collective_buffers(config, num_tokens, tp_size, tier=tier, weight_layout=weight_layout,
                                 sums=config.sum_plan(tp_size, platform))
    return compiled, tuple((buffer.codec, buffer.form) for buffer in buffers)
