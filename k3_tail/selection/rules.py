"""Which tier serves a call, and why: vLLM's rule order without its silent fallbacks, at trace time (T is static
under jit), so nothing per call."""

from __future__ import annotations

import dataclasses

import jax

from k3_tail._checks import check_int
from k3_tail.config import TailConfig, check_config
from k3_tail.hardware import GPU_PLATFORMS, check_device_kind, check_platform
from k3_tail.ops.collectives import SPLIT, describe_auto
from k3_tail.ops.columns import check_weight_layout, padded_hidden_size
from k3_tail.ops.tokens import padded_token_count
from k3_tail.policy import SelectionPolicy
from k3_tail.selection.buffers import collective_buffers
from k3_tail.selection.decision import TierDecision
from k3_tail.tiers.record import SUM_KINDS
from k3_tail.tiers.registry import Tier


def select_tier(
    config: TailConfig,
    num_tokens: int,
    tp_size: int,
    *,
    weight_layout: str | None = None,
    device_kind: str | None = None,
    platform: str | jax.Device | None = None,
) -> TierDecision:
    """Pick the tier for a call with ``num_tokens`` tokens (T) on ``tp_size`` (p) TP ranks.

    The fast tiers need p > 1, a shared-expert partial, an unreduced routed output and T > 0; otherwise NATIVE,
    the rule naming the failed condition, whatever the policy.

    Args:
      config: the tail's :class:`~k3_tail.TailConfig`; ``config.selection_policy`` picks once the
        preconditions hold (None: :class:`VllmRules`).
      num_tokens, tp_size: T >= 0 and p >= 1.
      weight_layout, device_kind: the call's kernel layout and its devices' ``.device_kind`` (None: not known).
      platform: a device of the call's mesh (its :func:`~k3_tail.hardware.device_platform` decides), or "cpu",
        "gpu", "tpu", "cuda" or "rocm"; None: not known. "gpu" selects as either vendor does.

    Returns:
      The :class:`TierDecision`: the tier, its rule and the notes on this call (how its sums travel, how it
      shards tokens, how a reduced shared output changes it).

    Raises:
      ValueError: naming the argument for a bad one, or the policy's (a table measured elsewhere, the cost
        model without ``weight_layout``).
    """
    check_config(config)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    if weight_layout is not None:
        weight_layout = check_weight_layout(weight_layout)
    device_kind = check_device_kind(device_kind)
    platform_name = check_platform(platform)
    decision = choose_tier(config, num_tokens, tp_size, weight_layout=weight_layout, device_kind=device_kind,
                           platform=platform)
    by_policy = _precondition(config, num_tokens, tp_size) is None
    gpu_rules = gpu_rules_note(config, platform_name) if by_policy else None
    notes = _call_notes(config, decision.tier, num_tokens, tp_size, weight_layout, platform_name, gpu_rules)
    return dataclasses.replace(decision, notes=decision.notes + notes)


def choose_tier(config: TailConfig, num_tokens: int, tp_size: int, *, weight_layout: str | None,
                device_kind: str | None, platform: str | jax.Device | None) -> TierDecision:
    """:func:`select_tier`'s tier and rule for checked arguments, without the notes: what a traced call asks for."""
    decision = _precondition(config, num_tokens, tp_size)
    if decision is not None:
        return decision
    policy = config.selection_policy or VllmRules()
    # As given: a device of a backend k3_tail does not list is taken, its platform's name would not be.
    return policy.select(config, num_tokens, tp_size, weight_layout=weight_layout, device_kind=device_kind,
                         platform=platform)


def _precondition(config: TailConfig, num_tokens: int, tp_size: int) -> TierDecision | None:
    """NATIVE with the failed precondition of the fast tiers, or None when they all hold."""
    if tp_size == 1:
        return TierDecision(Tier.NATIVE, "tp_size == 1: no tensor parallelism, nothing to reduce or shard")
    if not config.has_shared_experts:
        return TierDecision(
            Tier.NATIVE,
            "has_shared_experts is False: no shared-expert partial to overlap or fold into the projection",
        )
    if config.routed_output_is_reduced:
        return TierDecision(
            Tier.NATIVE,
            "routed_output_is_reduced is True: the routed output is already reduced (expert-parallel combine)",
        )
    if num_tokens == 0:
        return TierDecision(Tier.NATIVE, "num_tokens == 0: empty batch, the result is an empty [0, H]")
    return None


@dataclasses.dataclass(frozen=True)
class VllmRules(SelectionPolicy):
    """vLLM's rules from the config's switches (the default ``selection_policy``), in order: docs/design.md,
    "Selection". ONE_SHOT is never selected here: only a cost model or a measured table can say where its full
    GEMM per rank for one collective fewer wins; force it with ``tier=``.
    """

    def select(self, config: TailConfig, num_tokens: int, tp_size: int, *, weight_layout: str | None = None,
               device_kind: str | None = None, platform: str | jax.Device | None = None) -> TierDecision:
        platform = check_platform(platform)
        minimum = config.prefill_token_parallel_min_tokens
        if not (config.sequence_parallel and minimum and num_tokens >= minimum):
            return _fused_kernel_rules(config, num_tokens, tp_size, platform)
        why = f"sequence-parallel output and T={num_tokens} >= prefill_token_parallel_min_tokens={minimum}"
        if weight_layout == "replicated":
            return TierDecision(Tier.TOKEN_PARALLEL, f"{why} with the replicated kernel")
        later = _fused_kernel_rules(config, num_tokens, tp_size, platform)
        return dataclasses.replace(later, rule=f"{later.rule} (not token_parallel although {why}: it needs "
                                               f"weight_layout='replicated', got {weight_layout!r})")


def _fused_kernel_rules(config: TailConfig, num_tokens: int, tp_size: int, platform: str | None) -> TierDecision:
    """Rules 2-5 of :class:`VllmRules`: scatter-gather or one_kernel for a small enough T, else the next rules."""
    if config.use_scatter_gather and num_tokens <= config.scatter_gather_max_tokens:
        return TierDecision(
            Tier.SCATTER_GATHER,
            f"use_scatter_gather is True and T={num_tokens} <= "
            f"scatter_gather_max_tokens={config.scatter_gather_max_tokens}",
        )
    one_kernel = Tier.ONE_KERNEL.record
    # Where its kernel runs compiled (the GPU platforms), not interpreted.
    if not one_kernel.runs_interpreted_on(platform) and num_tokens <= config.one_kernel_max_tokens:
        why = f"T={num_tokens} <= one_kernel_max_tokens={config.one_kernel_max_tokens} on {platform}"
        reason = one_kernel.why_not("column", config)
        if reason is None:
            return TierDecision(Tier.ONE_KERNEL, f"{why}: one GPU kernel per call besides its two all-reduces")
        later = _overlap_threshold_rules(config, num_tokens, tp_size)
        return dataclasses.replace(later, rule=f"{later.rule} (not one_kernel although {why}: {reason})")
    return _overlap_threshold_rules(config, num_tokens, tp_size)


def _overlap_threshold_rules(config: TailConfig, num_tokens: int, tp_size: int) -> TierDecision:
    """Rules 4-5 of :class:`VllmRules`: overlap (or native) up to ``overlap_token_threshold``, then column-parallel."""
    within = num_tokens <= config.overlap_token_threshold
    if within and config.shared_output_is_reduced:
        return TierDecision(Tier.NATIVE, f"T={num_tokens} <= overlap_token_threshold={config.overlap_token_threshold}, "
                                         "but shared_output_is_reduced is True: the shared all-reduce already ran, "
                                         "so overlap would have nothing to hide and runs native's schedule; "
                                         "native it is")
    if within and not config.disable_overlap:
        return TierDecision(Tier.OVERLAP, f"T={num_tokens} <= overlap_token_threshold={config.overlap_token_threshold}")
    if within:
        rule = f"disable_overlap is True (T={num_tokens} <= overlap_token_threshold would pick overlap)"
    else:
        rule = f"T={num_tokens} > overlap_token_threshold={config.overlap_token_threshold}"
    if config.hidden_size % tp_size == 0:
        return TierDecision(Tier.COLUMN_PARALLEL, rule)
    return TierDecision(Tier.COLUMN_PARALLEL, rule, (
        f"hidden_size={config.hidden_size} is not divisible by tp_size={tp_size}, so the projection's columns "
        f"are padded to {padded_hidden_size(config.hidden_size, tp_size)} and sliced back",))


def unlike_the_rules(config: TailConfig, num_tokens: int, tp_size: int, tier: Tier, *, weight_layout: str | None,
                     platform: str | None) -> str:
    """A clause for another policy's reason where its ``tier`` is not :class:`VllmRules`' for the call
    ("; unlike the default rules, which ..."), else ""."""
    rules = VllmRules().select(config, num_tokens, tp_size, weight_layout=weight_layout, platform=platform)
    if tier is rules.tier:
        return ""
    stop = ""
    if tier is Tier.ONE_KERNEL and num_tokens > config.one_kernel_max_tokens:
        stop = f"stop one_kernel at one_kernel_max_tokens={config.one_kernel_max_tokens} and "
    return f"; unlike the default rules, which {stop}pick {rules.tier.value} ({rules.rule})"


def gpu_rules_note(config: TailConfig, platform: str | None) -> str | None:
    """The note that the default rules are vLLM's GPU thresholds, where they pick for a platform known to be no
    GPU ("cpu", "tpu"), with how to measure this machine instead; else None."""
    if platform is None or platform in GPU_PLATFORMS:
        return None
    if config.selection_policy is not None and not isinstance(config.selection_policy, VllmRules):
        return None
    return (f"the rules are vLLM's GPU thresholds, not measured on this {platform} platform: "
            "`python -m k3_tail calibrate --out table.json` times the tiers here, and "
            "TailConfig(selection_policy=SelectionTable.load('table.json')) selects by them")


def _call_notes(config: TailConfig, tier: Tier, num_tokens: int, tp_size: int, weight_layout: str | None,
                platform: str | None, gpu_rules: str | None) -> tuple[str, ...]:
    """The facts about this call of ``tier``, each only where it applies: ``gpu_rules``, how its sums travel or
    are quantised, how a reduced shared output and token-sharded output (padded tokens) change the tier."""
    # A tier's sums (all-reduces, reduce-scatters) do not depend on the kernel's layout.
    layout = weight_layout or ("replicated" if tier.record.needs_whole_kernel else "column")
    buffers = collective_buffers(config, num_tokens, tp_size, tier=tier, weight_layout=layout,
                                 sums=config.sum_plan(tp_size, platform))
    sums = [buffer for buffer in buffers if buffer.kind in SUM_KINDS and buffer.nbytes] if tp_size > 1 else []
    minimum = config.quantization_min_bytes(tp_size)

    notes = [gpu_rules] if gpu_rules is not None else []
    all_reduces = [buffer for buffer in sums if buffer.form is not None]
    if config.all_reduce_form != "auto" and all_reduces:
        notes.append(f"all_reduce_form={config.all_reduce_form!r}")
    elif any(buffer.form == SPLIT for buffer in all_reduces):
        notes.append(describe_auto(platform, config.dtype))
    codec = config.all_reduce_quantization
    if codec is not None and sums and minimum is None:
        notes.append(f"all_reduce_quantization={codec!r} quantises nothing here (vLLM has no minimum size for "
                     f"{config.dtype.name})")
    elif codec is not None and sums:
        source = "" if config.quantized_all_reduce_min_bytes is not None else " (vLLM's minimum for the dtype and p)"
        quantized = [f"{b.kind} of {b.nbytes / 1e6:.3g} MB" for b in sums if b.codec is not None]
        plain = [f"{b.kind} of {b.nbytes / 1e6:.3g} MB" for b in sums if b.codec is None]
        notes.append(f"{codec}-quantised two-shot sums for buffers of {minimum / 2**20:g} MiB{source} to "
                     f"{config.quantized_all_reduce_max_bytes / 2**20:g} MiB: quantised here: "
                     f"{', '.join(quantized) or 'none'}"
                     + (f"; outside that range, in {config.dtype.name}: {', '.join(plain)}" if plain else ""))
    if config.shared_output_is_reduced:
        notes.append(f"shared output reduced before the tail: {tier.record.prose.shared_reduced_form}")
    if config.sequence_parallel:
        notes.append(f"sequence-parallel output: {tier.record.prose.token_sharded_form}")
    padded = padded_token_count(num_tokens, tp_size)
    if config.sequence_parallel and padded != num_tokens:
        why = "is empty" if num_tokens == 0 else f"is not divisible by tp_size={tp_size}"
        notes.append(f"T={num_tokens} {why} and JAX arrays shard evenly only, so the tokens are padded with zero "
                     f"rows to T'={padded}: each rank returns its {padded // tp_size} of the [{padded}, H] output, "
                     f"whose rows from {num_tokens} on are padding")
    return tuple(notes)
