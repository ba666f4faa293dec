"""Which tier serves a call, and why: vLLM's rule order (spec, section 4) without its silent fallbacks.

Selection runs at trace time (the token count is static under jit), so it costs nothing per call,
and every outcome carries a reason that names the rule or the failed precondition.
"""

from __future__ import annotations

import dataclasses
import enum

from k3_tail.columns import padded_hidden_size
from k3_tail.config import TailConfig, check_int


class Tier(str, enum.Enum):
    """The schedules of the tail. All compute the same function (spec, section 2).

    NATIVE: AR(r); norm; full GEMM; AR(s); add. The base path and reference semantics.
    OVERLAP: AR(r) + norm; full GEMM while AR(s) is in flight; add (vLLM tier 1).
    COLUMN_PARALLEL: AR(r) + norm; each rank adds its column block of the projection into its own
        columns of its shared partial; one AR of [T, H] stitches and sums (vLLM tier 2).
    SCATTER_GATHER: AR(r) + norm; RS(s) over columns; shard GEMM + add; AG of [T, H/p] blocks
        (the standard-collective form of vLLM's fused tier 0).
    """

    NATIVE = "native"
    OVERLAP = "overlap"
    COLUMN_PARALLEL = "column_parallel"
    SCATTER_GATHER = "scatter_gather"

    @classmethod
    def parse(cls, value: Tier | str, *, argument: str = "tier") -> Tier:
        """``value`` as a Tier; a string may be the value ("overlap") or the name ("OVERLAP")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for tier in cls:
                if value in (tier.value, tier.name):
                    return tier
        choices = ", ".join(repr(t.value) for t in cls)
        raise ValueError(f"{argument}: expected a k3_tail.Tier or one of {choices}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TierDecision:
    """The tier chosen for one (config, token count, TP size), with the human-readable reason."""

    tier: Tier
    reason: str

    def __str__(self) -> str:
        return f"{self.tier.value}: {self.reason}"


def select_tier(config: TailConfig, num_tokens: int, tp_size: int) -> TierDecision:
    """Pick the tier for a call with ``num_tokens`` tokens (T) on ``tp_size`` (p) TP ranks.

    The rules, in order:
      1. The fast tiers need p > 1, a shared-expert partial, an unreduced routed output, no sequence
         parallelism and a non-empty batch; otherwise NATIVE, the reason naming the failed condition.
         (routed_scaling_factor is honoured by every tier, so unlike vLLM's ROCm runner it is no
         precondition.)
      2. SCATTER_GATHER if ``config.use_scatter_gather`` and T <= ``scatter_gather_max_tokens``.
      3. OVERLAP if T <= ``overlap_token_threshold`` and overlap is not disabled.
      4. COLUMN_PARALLEL otherwise; when H % p != 0 the projection's columns are padded to the next
         multiple of p and sliced back, so no columns are dropped and no fallback is needed.
    """
    if not isinstance(config, TailConfig):
        raise ValueError(f"config: expected a k3_tail.TailConfig, got {type(config).__name__}")
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)

    if tp_size == 1:
        return TierDecision(Tier.NATIVE, "tp_size == 1: no tensor parallelism, nothing to reduce or shard")
    if not config.has_shared_experts:
        return TierDecision(
            Tier.NATIVE,
            "has_shared_experts is False: no shared-expert partial to overlap or fold into the projection",
        )
    if config.fused_output_is_reduced:
        return TierDecision(
            Tier.NATIVE,
            "fused_output_is_reduced is True: the routed output is already reduced (expert-parallel combine)",
        )
    if config.sequence_parallel:
        return TierDecision(
            Tier.NATIVE, "sequence_parallel is True: the fast tiers do not serve token-sharded output in this version"
        )
    if num_tokens == 0:
        return TierDecision(Tier.NATIVE, "num_tokens == 0: empty batch, the result is an empty [0, H]")
    if config.use_scatter_gather and num_tokens <= config.scatter_gather_max_tokens:
        return TierDecision(
            Tier.SCATTER_GATHER,
            f"use_scatter_gather is True and T={num_tokens} <= "
            f"scatter_gather_max_tokens={config.scatter_gather_max_tokens}",
        )
    if num_tokens <= config.overlap_token_threshold:
        if not config.disable_overlap:
            return TierDecision(
                Tier.OVERLAP, f"T={num_tokens} <= overlap_token_threshold={config.overlap_token_threshold}"
            )
        why = f"disable_overlap is True (T={num_tokens} <= overlap_token_threshold would pick overlap)"
    else:
        why = f"T={num_tokens} > overlap_token_threshold={config.overlap_token_threshold}"
    if config.hidden_size % tp_size:
        why += (
            f"; hidden_size={config.hidden_size} is not divisible by tp_size={tp_size}, so the projection's "
            f"columns are padded to {padded_hidden_size(config.hidden_size, tp_size)} and sliced back"
        )
    return TierDecision(Tier.COLUMN_PARALLEL, why)

