"""Which tier serves a call, and why: vLLM's rule order without its silent fallbacks.

Selection runs at trace time (the token count is static under jit), so it costs nothing per call,
and every outcome carries a reason that names the rule or the failed precondition.
"""

from __future__ import annotations

from k3_tail._checks import check_int
from k3_tail.config import TailConfig, check_config
from k3_tail.selection import cost_model
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.table import SelectionTable
from k3_tail.ops.collectives import describe_auto
from k3_tail.ops.columns import padded_hidden_size
from k3_tail.tiers.record import SUM_KINDS
from k3_tail.tiers.registry import Tier
from k3_tail.ops.tokens import padded_token_count
from k3_tail.tiers.context import is_token_sharded_output


def select_tier(
    config: TailConfig,
    num_tokens: int,
    tp_size: int,
    *,
    weight_layout: str | None = None,
    device_kind: str | None = None,
    platform: str | None = None,
) -> TierDecision:
    """Pick the tier for a call with ``num_tokens`` tokens (T) on ``tp_size`` (p) TP ranks.

    ``weight_layout``, ``device_kind`` and ``platform`` (a device's ``.device_kind`` and
    ``.platform``) describe the call where the caller knows them: the "measured" and "model"
    policies need the first two to check or price the call, the token_parallel rule needs the
    layout, and with the platform the reason also says how the all-reduces travel there
    (``config.all_reduce_form``, :mod:`k3_tail.ops.collectives`).

    Rule 1 below holds for every ``config.selection_policy``; rules 2-4 are the "vllm" policy. The
    "measured" policy replaces them by the range of ``config.selection_table`` that holds T (the
    table must have been measured for this p, shapes, dtype, layout and device kind, else
    ValueError); the "model" policy by the tier :mod:`k3_tail.selection.cost_model` predicts fastest on
    ``config.hardware``. The reason names the policy's evidence.

    The rules, in order:
      1. The fast tiers need p > 1, a shared-expert partial, an unreduced routed output and a
         non-empty batch; otherwise NATIVE, the reason naming the failed condition.
         (routed_scaling_factor is honoured by every tier, so unlike vLLM's ROCm runner it is no
         precondition; nor is sequence parallelism, which every tier serves: see below.)
      2. TOKEN_PARALLEL for prefill with token-sharded output: ``config.sequence_parallel``,
         ``prefill_token_parallel_min_tokens`` > 0, T >= it and the replicated kernel layout (vLLM's
         VLLM_KIMI_K3_AMD_PREFILL_SP_MIN_TOKENS; the reason says when only the layout kept it out).
      3. SCATTER_GATHER if ``config.use_scatter_gather`` and T <= ``scatter_gather_max_tokens``.
      4. OVERLAP if T <= ``overlap_token_threshold`` and overlap is not disabled; NATIVE there when
         ``config.shared_output_is_reduced`` (vLLM's pre-reduced shared tail: nothing is left to
         overlap, and overlap's schedule then is native's).
      5. COLUMN_PARALLEL otherwise; when H % p != 0 the projection's columns are padded to the next
         multiple of p and sliced back, so no columns are dropped and no fallback is needed.
    With ``config.sequence_parallel`` the same rules pick the tier and the reason says how that tier
    returns token-sharded output (its record's ``token_sharded_form``); with
    ``config.shared_output_is_reduced``, how its schedule changes (``shared_reduced_form``). ONE_SHOT is never selected
    here: it trades a full GEMM per rank for one collective fewer, and only a cost model or a
    measured table for the hardware can say where that wins; force it with ``tier=``.
    """
    check_config(config)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)

    decision = _select_replicated(config, num_tokens, tp_size, weight_layout, device_kind)
    reason = decision.reason
    forms = describe_auto(platform, config.dtype) if config.all_reduce_form == "auto" else None
    if forms is not None:
        reason += f"; {forms}"
    elif config.all_reduce_form != "auto":
        reason += f"; all_reduce_form={config.all_reduce_form!r}"
    quantization = _quantization_reason(config, decision.tier, num_tokens, tp_size, weight_layout)
    if quantization is not None:
        reason += f"; {quantization}"
    if config.shared_output_is_reduced:
        reason += f"; shared output reduced before the tail: {decision.tier.record.shared_reduced_form}"
    if not config.sequence_parallel:
        return TierDecision(decision.tier, reason)
    reason = f"{reason}; sequence-parallel output: {decision.tier.record.token_sharded_form}"
    if not is_token_sharded_output(config, num_tokens, tp_size):
        why = "is empty" if num_tokens == 0 else f"is not divisible by tp_size={tp_size}"
        reason += (
            f"; T={num_tokens} {why} and JAX arrays shard evenly only, so the tokens are padded to "
            f"{padded_token_count(num_tokens, tp_size)} and the [T, H] result is gathered (replicated)"
        )
    return TierDecision(decision.tier, reason)


def _quantization_reason(config: TailConfig, tier: Tier, num_tokens: int, tp_size: int,
                         weight_layout: str | None) -> str | None:
    """Which of ``tier``'s sums travel quantised in this call, or None without a codec."""
    text = _describe_quantization(config, tp_size)
    if text is None or num_tokens == 0 or config.quantization_min_bytes(tp_size) is None:
        return text
    # The sums (all-reduces, reduce-scatters) of a tier do not depend on the kernel's layout.
    layout = weight_layout or ("replicated" if tier.record.needs_whole_kernel else "column")
    cost = cost_model.tier_cost(config, num_tokens, tp_size, tier=tier, weight_layout=layout)
    sums = [c for c in cost.collectives if c.kind in SUM_KINDS]
    quantized = [f"{c.kind} of {c.buffer_bytes / 1e6:.3g} MB" for c in sums if c.codec is not None]
    plain = [f"{c.kind} of {c.buffer_bytes / 1e6:.3g} MB" for c in sums if c.codec is None]
    text += f": quantised here: {', '.join(quantized) or 'none'}"
    return text + (f"; outside that range, in {config.dtype.name}: {', '.join(plain)}" if plain else "")


def _describe_quantization(config: TailConfig, tp_size: int) -> str | None:
    """Which sums ``config`` quantises over ``tp_size`` ranks, in words, or None when it has no codec."""
    codec = config.all_reduce_quantization
    if codec is None:
        return None
    minimum = config.quantization_min_bytes(tp_size)
    if minimum is None:
        why = "p = 1" if tp_size == 1 else f"vLLM has no minimum size for {config.dtype.name}"
        return f"all_reduce_quantization={codec!r} quantises nothing here ({why})"
    source = "" if config.quantized_all_reduce_min_bytes is not None else " (vLLM's minimum for the dtype and p)"
    return (f"{codec}-quantised two-shot sums for buffers of {minimum / 2**20:g} MiB{source} to "
            f"{config.quantized_all_reduce_max_bytes / 2**20:g} MiB")


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
    minimum = config.prefill_token_parallel_min_tokens
    if config.sequence_parallel and minimum and num_tokens >= minimum:
        why = f"sequence-parallel output and T={num_tokens} >= prefill_token_parallel_min_tokens={minimum}"
        if weight_layout == "replicated":
            return TierDecision(Tier.TOKEN_PARALLEL, f"{why} with the replicated kernel")
        later = _select_vllm_rest(config, num_tokens, tp_size)
        return TierDecision(later.tier, f"{later.reason} (not token_parallel although {why}: it needs "
                                        f"weight_layout='replicated', got {weight_layout!r})")
    return _select_vllm_rest(config, num_tokens, tp_size)


def _select_vllm_rest(config: TailConfig, num_tokens: int, tp_size: int) -> TierDecision:
    """The "vllm" policy's rules after the token-parallel one: scatter-gather, overlap, column-parallel."""
    if config.use_scatter_gather and num_tokens <= config.scatter_gather_max_tokens:
        return TierDecision(
            Tier.SCATTER_GATHER,
            f"use_scatter_gather is True and T={num_tokens} <= "
            f"scatter_gather_max_tokens={config.scatter_gather_max_tokens}",
        )
    if num_tokens <= config.overlap_token_threshold:
        within = f"T={num_tokens} <= overlap_token_threshold={config.overlap_token_threshold}"
        if config.shared_output_is_reduced:
            return TierDecision(Tier.NATIVE, f"{within}, but shared_output_is_reduced is True: the shared "
                                             "all-reduce already ran, so overlap would have nothing to hide and "
                                             "runs native's schedule; native it is")
        if not config.disable_overlap:
            return TierDecision(Tier.OVERLAP, within)
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
    if not isinstance(table, SelectionTable):
        raise ValueError(f"selection_table: expected a k3_tail.SelectionTable, got {type(table).__name__}")
    table.check_matches(config, tp_size, weight_layout=weight_layout, device_kind=device_kind)
    token_range = table.range_for(num_tokens)
    source = f", {table.source}" if table.source else ""
    return TierDecision(
        token_range.tier,
        f"measured selection table ({table.device_kind}, p={table.tp_size}, {table.weight_layout} layout{source}): "
        f"T={num_tokens} in {token_range}",
    )


def _select_by_model(config: TailConfig, num_tokens: int, tp_size: int, weight_layout: str | None) -> TierDecision:
    if weight_layout is None:
        raise ValueError('weight_layout: the "model" selection policy prices the call, so it needs its weight layout')
    decision = cost_model.best_tier(config, num_tokens, tp_size, hardware=config.hardware, weight_layout=weight_layout)
    return TierDecision(decision.tier, f"cost model: {decision.reason}")
