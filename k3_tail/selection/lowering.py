"""The tier of a call for the platform its program is lowered for, not the one that traces it.

A program traced on one host may be lowered for another (``jax.export`` with ``platforms=``, ahead-of-time
lowering, a multi-platform export run wherever it lands). What a call's program depends on its platform for is
therefore decided per lowering platform: the tier and whether its kernel compiles (and the form of the sums)
here, one branch per distinct program joined by ``jax.lax.platform_dependent``, which lowers only the branches
of the platforms being lowered; what differs between the GPU vendors alone (a kernel's warps, ROCm's rule that
keeps adds out of GEMMs) where each lowers, so that CUDA and ROCm share one traced branch. Where every platform's
program is the same there is one branch and no conditional.
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

# The platforms with a branch of their own; any other (a TPU) lowers the CPU's, as selection treats them alike
# (XLA's tiers, kernels interpreted).
LOWERING_PLATFORMS = ("cpu", *GPU_VENDOR_PLATFORMS)
_DEFAULT_PLATFORM = "cpu"


def per_lowering_platform(branches: Mapping[str, Hashable], run: Callable[..., Any], *operands: Any) -> Any:
    """``run(branches[platform], *operands)`` for the platform the program is lowered for.

    ``branches`` maps each of :data:`LOWERING_PLATFORMS` to a hashable description of the program ``run`` traces
    for it; platforms with equal descriptions share one traced branch. One description: ``run`` is traced once and
    called directly."""
    distinct = {branch: functools.partial(run, branch) for branch in dict.fromkeys(branches.values())}
    if len(distinct) == 1:
        (only,) = distinct.values()
        return only(*operands)
    per_platform = {platform: distinct[branches[platform]] for platform in LOWERING_PLATFORMS}
    return lax.platform_dependent(*operands, default=per_platform[_DEFAULT_PLATFORM], **per_platform)


@dataclasses.dataclass(frozen=True)
class TailBranch:
    """The program of one call's tail on the platforms that share it: the tier, and the platform its steps are
    traced for: one platform's name, "gpu" for both GPU vendors (their differences decided as each lowers), or
    None for every platform (nothing its steps read differs between them)."""

    tier: Tier
    platform: str | None


def tail_branches(config: TailConfig, num_tokens: int, tp_size: int, *, weight_layout: str,
                  tier: Tier | None) -> dict[str, TailBranch]:
    """The :class:`TailBranch` of a call for each of :data:`LOWERING_PLATFORMS`: ``tier`` (already checked to run)
    or :func:`~k3_tail.selection.rules.choose_tier`'s for that platform."""
    programs = {}
    for platform in LOWERING_PLATFORMS:
        chosen = tier or choose_tier(config, num_tokens, tp_size, weight_layout=weight_layout,
                                     device_kind=None, platform=platform).tier
        programs[platform] = (chosen, _platform_facts(config, num_tokens, tp_size, chosen, weight_layout, platform))
    return {platform: TailBranch(program[0], _shared_platform([other for other in LOWERING_PLATFORMS
                                                              if programs[other] == program]))
            for platform, program in programs.items()}


def _shared_platform(platforms: list[str]) -> str | None:
    """The platform name the steps of a branch shared by ``platforms`` are traced for (:class:`TailBranch`)."""
    if len(platforms) == 1:
        return platforms[0]
    return "gpu" if set(platforms) == set(GPU_VENDOR_PLATFORMS) else None


def _platform_facts(config, num_tokens, tp_size, tier, weight_layout, platform) -> tuple:
    """What ``tier``'s steps read of ``platform`` when traced: whether its kernel compiles, and how each collective
    of the call travels (codec and all-reduce form)."""
    record = tier.record
    compiled = None if record.compiled_on is None else not record.runs_interpreted_on(platform)
    buffers = collective_buffers(config, num_tokens, tp_size, tier=tier, weight_layout=weight_layout,
                                 sums=config.sum_plan(tp_size, platform))
    return compiled, tuple((buffer.codec, buffer.form) for buffer in buffers)
