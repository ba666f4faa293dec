"""Which tier serves a call, and why: vLLM's rule order (spec, section 4) without its silent fallbacks.

Selection runs at trace time (the token count is static under jit), so it costs nothing per call,
and every outcome carries a reason that names the rule or the failed precondition.
"""

from __future__ import annotations

import dataclasses
import enum

from k3_tail.columns import padded_hidden_size
from k3_tail.config import TailConfig, check_int
from k3_tail.sequence_parallel import padded_token_count


class Tier(str, enum.Enum):
    """The schedules of the tail. All compute the same function (spec, section 2).

    NATIVE: AR(r); norm; full GEMM; AR(s); add. The base path and reference semantics.
    OVERLAP: AR(r) + norm; full GEMM while AR(s) is in flight; add (vLLM tier 1).
    COLUMN_PARALLEL: AR(r) + norm; each rank adds its column block of the projection into its own
        columns of its shared partial; one AR of [T, H] stitches and sums (vLLM tier 2).
    SCATTER_GATHER: AR(r) + norm; RS(s) over columns; shard GEMM + add; AG of [T, H/p] blocks
        (the standard-collective form of vLLM's fused tier 0).
    ONE_SHOT: each rank projects its own (c r_i g); one AR of the packed [s | (c r g) @ W | c r];
        the row RMS factor applied after (spec, section 3; not in vLLM). Needs the whole kernel on
        every rank: only the "replicated" weight layout.
    """

    NATIVE = "native"
    OVERLAP = "overlap"
    COLUMN_PARALLEL = "column_parallel"
    SCATTER_GATHER = "scatter_gather"
    ONE_SHOT = "one_shot"

    def supports(self, weight_layout: str, config: TailConfig | None = None) -> bool:
        """Whether the tier runs with ``weight_layout`` ("column" or "replicated") and ``config``."""
        return self.why_not(weight_layout, config) is None

    def why_not(self, weight_layout: str, config: TailConfig | None = None) -> str | None:
        """Why the tier cannot run with ``weight_layout`` and ``config`` (None: not considered), or
        None when it can: one_shot needs the whole kernel and the routed partials unreduced."""
        if self is not Tier.ONE_SHOT:
            return None
        if weight_layout != "replicated":
            return f"one_shot does not run with weight_layout={weight_layout!r} (it needs 'replicated')"
        if config is not None and config.fused_output_is_reduced:
            return "one_shot reduces the routed partials itself, so it cannot serve fused_output_is_reduced=True"
        return None

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


def select_tier(
    config: TailConfig,
    num_tokens: int,
    tp_size: int,
    *,
    weight_layout: str | None = None,
    device_kind: str | None = None,
) -> TierDecision:
    """Pick the tier for a call with ``num_tokens`` tokens (T) on ``tp_size`` (p) TP ranks.

    ``weight_layout`` and ``device_kind`` (a device's ``.device_kind``) describe the call where the
    caller knows them: the "measured" and "model" policies need them to check or price the call.

    Rule 1 below holds for every ``config.selection_policy``; rules 2-4 are the "vllm" policy. The
    "measured" policy replaces them by the range of ``config.selection_table`` that holds T (the
    table must have been measured for this p, shapes, dtype, layout and device kind, else
    ValueError); the "model" policy by the tier :mod:`k3_tail.cost_model` predicts fastest on
    ``config.hardware``. The reason names the policy's evidence.

    The rules, in order:
      1. The fast tiers need p > 1, a shared-expert partial, an unreduced routed output and a
         non-empty batch; otherwise NATIVE, the reason naming the failed condition.
         (routed_scaling_factor is honoured by every tier, so unlike vLLM's ROCm runner it is no
         precondition; nor is sequence parallelism, which every tier serves: see below.)
      2. SCATTER_GATHER if ``config.use_scatter_gather`` and T <= ``scatter_gather_max_tokens``.
      3. OVERLAP if T <= ``overlap_token_threshold`` and overlap is not disabled.
      4. COLUMN_PARALLEL otherwise; when H % p != 0 the projection's columns are padded to the next
         multiple of p and sliced back, so no columns are dropped and no fallback is needed.
    With ``config.sequence_parallel`` the same rules pick the tier and the reason says how that tier
    returns token-sharded output (:mod:`k3_tail.sequence_parallel`). ONE_SHOT is never selected
    here: it trades a full GEMM per rank for one collective fewer, and only a cost model or a
    measured table for the hardware can say where that wins; force it with ``tier=``.
    """
    if not isinstance(config, TailConfig):
        raise ValueError(f"config: expected a k3_tail.TailConfig, got {type(config).__name__}")
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)

    decision = _select_replicated(config, num_tokens, tp_size, weight_layout, device_kind)
    if not config.sequence_parallel:
        return decision
    reason = f"{decision.reason}; sequence-parallel output: {_SP_FORM[decision.tier]}"
    if num_tokens % tp_size:
        reason += (
            f"; T={num_tokens} is not divisible by tp_size={tp_size} and JAX arrays shard evenly only, so the "
            f"tokens are padded to {padded_token_count(num_tokens, tp_size)} and the [T, H] result is gathered "
            "(replicated)"
        )
    return TierDecision(decision.tier, reason)


# How each tier makes token-sharded [T/p, H] output (sequence_parallel=True).
_SP_FORM = {
    Tier.NATIVE: "AR(s) becomes a reduce-scatter over tokens and each rank keeps its rows of the projection",
    Tier.OVERLAP: "AR(s) becomes a reduce-scatter over tokens and each rank keeps its rows of the projection",
    Tier.COLUMN_PARALLEL: "the final AR becomes a reduce-scatter over tokens",
    Tier.SCATTER_GATHER: "the final all-gather over columns becomes an all-to-all from columns to tokens",
    Tier.ONE_SHOT: "the packed all-reduce becomes a reduce-scatter over tokens",
}


def _select_replicated(
    config: TailConfig, num_tokens: int, tp_size: int, weight_layout: str | None, device_kind: str | None
) -> TierDecision:
    """The rules of :func:`select_tier`, whatever the output's token sharding."""
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
    if num_tokens == 0:
        return TierDecision(Tier.NATIVE, "num_tokens == 0: empty batch, the result is an empty [0, H]")
    if config.selection_policy == "measured":
        return _select_measured(config, num_tokens, tp_size, weight_layout, device_kind)
    if config.selection_policy == "model":
        return _select_by_model(config, num_tokens, tp_size, weight_layout)
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


def _select_measured(
    config: TailConfig, num_tokens: int, tp_size: int, weight_layout: str | None, device_kind: str | None
) -> TierDecision:
    table = config.selection_table
    table.check_matches(config, tp_size, weight_layout=weight_layout, device_kind=device_kind)
    token_range = table.range_for(num_tokens)
    source = f", {table.source}" if table.source else ""
    return TierDecision(
        token_range.tier,
        f"measured selection table ({table.device_kind}, p={table.tp_size}, {table.weight_layout} layout{source}): "
        f"T={num_tokens} in {token_range}",
    )


def _select_by_model(config: TailConfig, num_tokens: int, tp_size: int, weight_layout: str | None) -> TierDecision:
    from k3_tail import cost_model  # imported here: the cost model builds on this module

    if weight_layout is None:
        raise ValueError('weight_layout: the "model" selection policy prices the call, so it needs its weight layout')
    decision = cost_model.best_tier(config, num_tokens, tp_size, hardware=config.hardware, weight_layout=weight_layout)
    return TierDecision(decision.tier, f"cost model: {decision.reason}")
