"""The tier of a call for the platform its program is lowered for, not the one that traces it.

A program traced on one host may be lowered for another (``jax.export`` with ``platforms=``, ahead-of-time
lowering, a multi-platform export run wherever it lands). What a call's program depends on its platform for
(the tier, a kernel compiled or interpreted, its warps, the ROCm rule that keeps adds out of GEMMs, the form of
the sums) is therefore decided per lowering platform: one branch per distinct program, joined by
``jax.lax.platform_dependent``, which lowers only the branches of the platforms being lowered. Where every
platform's program is the same there is one branch and no conditional.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any

from jax import lax

from k3_tail.config import TailConfig
from k3_tail.ops.fused_launch import warps_per_program
from k3_tail.selection.buffers import collective_buffers
from k3_tail.selection.rules import select_tier
from k3_tail.tiers.registry import Tier

# The platforms with a branch of their own; any other (a TPU) lowers the CPU's, as selection treats them alike
# (XLA's tiers, kernels interpreted).
LOWERING_PLATFORMS = ("cpu", "cuda", "rocm")
_DEFAULT_PLATFORM = "cpu"


def per_lowering_platform(branch_for: Callable[[str], Hashable], run: Callable[..., Any], *operands: Any) -> Any:
    """``run(branch_for(platform), *operands)`` for the platform the program is lowered for.

    ``branch_for`` maps each of :data:`LOWERING_PLATFORMS` to a hashable description of the program ``run``
    traces for it; platforms with equal descriptions share one traced branch. One description: ``run`` is
    traced once and called directly."""
    branches = {platform: branch_for(platform) for platform in LOWERING_PLATFORMS}
    distinct = {branch: functools.partial(run, branch) for branch in dict.fromkeys(branches.values())}
    if len(distinct) == 1:
        (only,) = distinct.values()
        return only(*operands)
    per_platform = {platform: distinct[branch] for platform, branch in branches.items()}
    return lax.platform_dependent(*operands, default=per_platform[_DEFAULT_PLATFORM], **per_platform)


@dataclasses.dataclass(frozen=True)
class TailBranch:
    """The program of one call's tail on a lowering platform: the tier and the platform its steps are traced
    for (a representative of the platforms whose programs are the same)."""

    tier: Tier
    platform: str


def tail_branch(config: TailConfig, num_tokens: int, tp_size: int, *, weight_layout: str, tier: Tier | None,
                platform: str, device_kind: str | None = None) -> TailBranch:
    """The :class:`TailBranch` of a call lowered for ``platform``: ``tier`` (already checked to run), or
    :func:`~k3_tail.select_tier`'s for that platform; its platform reduced to what the traced steps read."""
    if tier is None:
        tier = select_tier(config, num_tokens, tp_size, weight_layout=weight_layout, device_kind=device_kind,
                           platform=platform).tier
    return TailBranch(tier, _program_platform(config, num_tokens, tp_size, tier, weight_layout, platform))


def _program_platform(config: TailConfig, num_tokens: int, tp_size: int, tier: Tier, weight_layout: str,
                      platform: str) -> str:
    """``platform``, or the CPU where ``tier``'s steps read nothing of it that differs from the CPU's: ROCm keeps
    adds out of GEMMs; a kernel compiles (with its warps) on a GPU; the CPU splits large all-reduces."""
    if platform == "rocm" or platform == _DEFAULT_PLATFORM:
        return platform
    record = tier.record
    if record.compiled_on is not None and (record.runs_interpreted_on(platform) != record.runs_interpreted_on(
            _DEFAULT_PLATFORM) or warps_per_program(platform) != warps_per_program(_DEFAULT_PLATFORM)):
        return platform
    forms = [_sum_forms(config, num_tokens, tp_size, tier, weight_layout, name) for name in (platform,
                                                                                            _DEFAULT_PLATFORM)]
    return _DEFAULT_PLATFORM if forms[0] == forms[1] else platform


def _sum_forms(config, num_tokens, tp_size, tier, weight_layout, platform) -> tuple:
    """How each collective of the call travels on ``platform`` (codec and all-reduce form)."""
    buffers = collective_buffers(config, num_tokens, tp_size, tier=tier, weight_layout=weight_layout,
                                 sums=config.sum_plan(tp_size, platform))
    return tuple((buffer.codec, buffer.form) for buffer in buffers)
