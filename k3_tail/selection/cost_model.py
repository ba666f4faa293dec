"""What each tier costs per rank, how long it should take on a given GPU, and where the tiers cross over.

1. **Counts** (:func:`tier_cost`), exact for the program each tier builds: per TP rank, for T tokens, L -> H,
   p ranks, d bytes per element of ``config.dtype`` and Hb = padded_hidden_size(H, p) / p:

   - ``gemm_flops``: 2*rows*L*columns, with the tier record's ``gemm_rows`` and ``gemm_columns`` (H or Hb).
   - ``weight_bytes``: the kernel bytes the GEMM reads, w*L*columns (w = d, or 1 for FP8 plus a float32 scale
     per column; once per tile of its own kernel's rows), plus d*L of norm weight with ``use_latent_norm``.
   - ``activation_bytes``: d*(T*L + T*H + T*H), the routed and shared inputs and this rank's rows of y (no
     shared partial: no second term; token-sharded output: T'/p rows of y, and of a reduced shared output):
     the program's activation arguments and result per rank. XLA's intermediates are not counted.
   - ``scratch_bytes``: a kernel's own scratch (``OwnKernel.scratch_bytes``), written and read back: twice.
   - ``collectives``: the record's terms in issue order, as
     :class:`~k3_tail.selection.collective_cost.CollectiveCost`. With sequence-parallel output, and for a tier
     that splits tokens, the tier works on T' = ``padded_token_count(T, p)`` rows (every figure but the
     inputs' activation bytes). T = 0 without sequence-parallel output costs nothing.
   - ``gpu_kernels``: the record's :class:`~k3_tail.tiers.record.GpuKernelCounts`.
   - ``grid_programs``: the programs of one_kernel's grid (None for XLA's kernels); ``grid_fill`` =
     min(1, programs / ``TARGET_PROGRAMS``).

2. **Time** (:func:`predict_time`), with the :class:`Hardware` figures:

       local      = max(gemm_flops / peak, (weight_bytes + activation_bytes + scratch_bytes) / hbm_bytes_per_s)
                    / grid_fill
       collective = collective_latency_s + wire_bytes / link_bytes_per_s   (0 for a group of 1 rank)
       launches   = gpu_kernels (on the preset's platform) * kernel_launch_s
       total      = sum(serial collectives) + max(local, sum(hidden collectives)) + launches

   peak: ``peak_fp8_flops`` for a GEMM of two FP8 operands (``fp8_activations``) in a format of the preset's
   ``fp8_formats``, else ``peak_flops``. A collective is hidden when its term runs beside the GEMM; a quantised
   sum adds its codec's shots and memory passes (:mod:`k3_tail.selection.collective_cost`).

Assumptions:
- The presets hold data-sheet peaks, which real kernels reach only in part: times are optimistic, and the
  crossovers rest on the ratios. ``collective_latency_s`` (10 us) and ``kernel_launch_s`` (2 us) are
  assumptions. Replace any field with a measurement: ``dataclasses.replace(HARDWARE["mi355x"], ...)``.
- A ring collective drives ``link_bytes_per_s`` fully (:mod:`k3_tail.selection.collective_cost`).
- Collectives run one at a time, as the tier issues them (XLA on GPU may combine two all-reduces); a hidden one
  shares neither HBM bandwidth nor compute units with the GEMM. The latent all-reduce precedes the GEMM.
- A column tier on the replicated layout reads only its own block (XLA on GPU copies that slice first: 2*d*L*Hb
  bytes more, not counted). Elementwise work costs no FLOPs; its traffic is in ``activation_bytes``.
- Every kernel runs at the roofline, one_kernel's at ``grid_fill`` of it (a grid below ``TARGET_PROGRAMS``
  has fewer loads in flight: taken as proportional); its tiles are sized for decode, and no measurement backs
  its time beyond.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping

import jax
import numpy as np

from k3_tail._checks import check_int
from k3_tail.config import TailConfig, check_config
from k3_tail.hardware import GPU_VENDOR_PLATFORMS, HARDWARE, Hardware, check_platform, hardware_preset
from k3_tail.ops.collectives import SumPlan
from k3_tail.ops.columns import check_weight_layout
from k3_tail.ops.fused_launch import TARGET_PROGRAMS
from k3_tail.policy import SelectionPolicy
from k3_tail.selection.buffers import collective_buffers, tier_rows
from k3_tail.selection.collective_cost import CollectiveCost, check_kind
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.rules import unlike_the_rules
from k3_tail.tiers.context import is_token_sharded_output
from k3_tail.tiers.record import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER
from k3_tail.tiers.registry import Tier

__all__ = [
    "ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "HARDWARE", "REDUCE_SCATTER", "CostModelPolicy", "Crossover",
    "Hardware", "Prediction", "TierCost", "best_tier", "crossovers", "predict_time", "tier_cost",
]


@dataclasses.dataclass(frozen=True)
class TierCost:
    """Per-rank cost of one tail call by one tier (module docstring: the fields). fp8_gemm: the FP8 format of
    both GEMM operands, else None; gpu_kernels: by XLA platform ("cuda", "rocm")."""

    tier: Tier
    num_tokens: int
    tp_size: int
    weight_layout: str
    gemm_flops: int
    weight_bytes: int
    activation_bytes: int
    collectives: tuple[CollectiveCost, ...]
    fp8_gemm: str | None = None
    gpu_kernels: Mapping[str, int] = dataclasses.field(default_factory=dict)
    scratch_bytes: int = 0
    grid_programs: int | None = None

    @property
    def grid_fill(self) -> float:
        """min(1, grid_programs / TARGET_PROGRAMS); 1 for XLA's kernels and for a call with no work."""
        if not self.grid_programs:
            return 1.0
        return min(1.0, self.grid_programs / TARGET_PROGRAMS)

    def collective_bytes(self, kind: str) -> int:
        """Sum of ``buffer_bytes`` of the collectives of ``kind`` (0 when there is none)."""
        check_kind(kind)
        return sum(collective.buffer_bytes for collective in self.collectives if collective.kind == kind)


def tier_cost(
    config: TailConfig, num_tokens: int, tp_size: int, *, tier: Tier | str, weight_layout: str = "replicated"
) -> TierCost:
    """The per-rank :class:`TierCost` of ``tier`` for T = ``num_tokens`` on p = ``tp_size`` ranks with
    ``weight_layout`` ("replicated" or "column"). ValueError naming the argument for a bad one, or for a tier that
    cannot run with the layout or config."""
    check_config(config)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    tier = Tier.parse(tier)
    weight_layout = check_weight_layout(weight_layout)
    tier.record.check_runs(weight_layout, config)
    return _tier_cost(config, num_tokens, tp_size, tier, weight_layout, config.sum_plan(tp_size))


def _tier_cost(config: TailConfig, num_tokens: int, tp_size: int, tier: Tier, weight_layout: str,
               sums: SumPlan) -> TierCost:
    if num_tokens == 0 and not config.sequence_parallel:
        return TierCost(tier, num_tokens, tp_size, weight_layout, 0, 0, 0, (),
                        gpu_kernels=dict.fromkeys(GPU_VENDOR_PLATFORMS, 0))
    element = config.dtype.itemsize
    latent, hidden = config.latent_size, config.hidden_size
    record = tier.record
    rows = tier_rows(config, tier, num_tokens, tp_size)
    token_sharded = is_token_sharded_output(config, num_tokens, tp_size)
    output_rows = rows // tp_size if token_sharded else num_tokens  # this rank's rows of the padded [T', H]
    shared_rows = num_tokens if config.has_shared_experts else 0
    if config.shared_output_is_reduced and token_sharded:
        shared_rows = output_rows  # this rank's rows of the reduced [T', H], sharded over tokens
    activation_bytes = element * (num_tokens * latent + shared_rows * hidden + output_rows * hidden)
    columns = record.gemm_columns(hidden, tp_size, weight_layout)
    norm_bytes = element * latent if config.use_latent_norm else 0
    if config.up_proj_dtype is None:
        kernel_bytes = element * latent * columns
    else:  # FP8 values and one float32 scale per column
        kernel_bytes = config.up_proj_dtype.itemsize * latent * columns + 4 * columns
    collectives = [
        CollectiveCost(buffer.kind, buffer.nbytes, tp_size, hidden=buffer.beside_gemm, element_bytes=element,
                       codec=None if buffer.codec is None else buffer.codec.name)
        for buffer in collective_buffers(config, num_tokens, tp_size, tier=tier, weight_layout=weight_layout,
                                         sums=sums)
    ]
    return TierCost(
        tier=tier,
        num_tokens=num_tokens,
        tp_size=tp_size,
        weight_layout=weight_layout,
        gemm_flops=2 * record.multiplied_rows(rows, tp_size) * latent * columns,
        weight_bytes=record.weight_reads(rows) * kernel_bytes + norm_bytes,
        activation_bytes=activation_bytes,
        collectives=tuple(collectives),
        fp8_gemm=config.up_proj_dtype.name if config.fp8_activations else None,
        gpu_kernels={platform: record.gpu_kernels.of(platform, weight_layout, num_tokens)
                     for platform in GPU_VENDOR_PLATFORMS},
        # Written once, read back once.
        scratch_bytes=0 if record.own_kernel is None else 2 * record.own_kernel.scratch_bytes(config, rows, tp_size),
        grid_programs=_grid_programs(config, tier, rows, tp_size),
    )


def _grid_programs(config: TailConfig, tier: Tier, rows: int, tp_size: int) -> int | None:
    """The programs of ``tier``'s own kernel's grid for ``rows`` token rows; None where XLA sizes the kernels."""
    if tier.record.own_kernel is None or rows == 0:
        return None
    return tier.record.own_kernel.launch_grid(config, rows, tp_size).programs


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted per-call times in seconds (module docstring: formulas): compute_s and memory_s at ``grid_fill``
    of the peaks; collective_s, hidden ones included; launch_s; total_s, hidden collectives overlapped."""

    compute_s: float
    memory_s: float
    collective_s: float
    total_s: float
    launch_s: float = 0.0

    @property
    def local_s(self) -> float:
        """The roofline time of the local work: max(compute_s, memory_s)."""
        return max(self.compute_s, self.memory_s)


def predict_time(cost: TierCost, hardware: Hardware | str) -> Prediction:
    """The :class:`Prediction` for ``cost`` on ``hardware`` (a :class:`Hardware` or a key of HARDWARE), by the
    module docstring's formulas; ValueError for a ``cost`` that is no TierCost or an unknown preset."""
    if not isinstance(cost, TierCost):
        raise ValueError(f"cost: expected a k3_tail.selection.cost_model.TierCost, got {type(cost).__name__}")
    hardware = hardware_preset(hardware)
    compute, memory, serial, hidden = _time_terms(cost, hardware)
    launches = cost.gpu_kernels.get(hardware.platform, 0) * hardware.kernel_launch_s
    return Prediction(compute_s=compute, memory_s=memory, collective_s=serial + hidden,
                      total_s=serial + max(compute, memory, hidden) + launches, launch_s=launches)


def _time_terms(cost: TierCost, hardware: Hardware) -> tuple[float, float, float, float]:
    """(compute, memory, serial collectives, hidden collectives) seconds of ``cost`` on ``hardware``."""
    serial = hidden = 0.0
    for collective in cost.collectives:
        seconds = collective.seconds(hardware)
        if collective.hidden:
            hidden += seconds
        else:
            serial += seconds
    peak = hardware.peak_fp8_flops if cost.fp8_gemm in hardware.fp8_formats else hardware.peak_flops
    return (
        cost.gemm_flops / (peak * cost.grid_fill),
        (cost.weight_bytes + cost.activation_bytes + cost.scratch_bytes) / (hardware.hbm_bytes_per_s * cost.grid_fill),
        serial,
        hidden,
    )


def best_tier(
    config: TailConfig,
    num_tokens: int,
    tp_size: int,
    *,
    hardware: Hardware | str,
    weight_layout: str = "replicated",
    tiers: Iterable[Tier | str] | None = None,
) -> TierDecision:
    """The tier with the smallest predicted time among ``tiers`` (default: every tier that runs), the first in
    ``Tier``'s order on a tie (within a relative 1e-9), and a reason quoting the predictions. ValueError naming
    a bad argument."""
    hardware = hardware_preset(hardware)
    check_config(config)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    candidates = _candidates(config, weight_layout, tiers)
    costs = _costs(config, num_tokens, tp_size, weight_layout, candidates, config.sum_plan(tp_size))
    times = [predict_time(cost, hardware).total_s for cost in costs]
    ranked = sorted(zip(times, costs, strict=True), key=lambda pair: pair[0])
    quoted = ", ".join(f"{cost.tier.value} {seconds * 1e6:.2f} us{_unfilled_grid(cost)}" for seconds, cost in ranked)
    return TierDecision(
        candidates[_first_fastest(times)],
        f"predicted fastest on {hardware.name} at T={num_tokens}, p={tp_size}, {weight_layout} weights: {quoted}",
    )


def _unfilled_grid(cost: TierCost) -> str:
    """" (its grid 784 of 1024 programs)" where the tier's own kernel does not fill the GPU, else ""."""
    if cost.grid_fill == 1:
        return ""
    return f" (its grid {cost.grid_programs} of {TARGET_PROGRAMS} programs)"


@dataclasses.dataclass(frozen=True)
class CostModelPolicy(SelectionPolicy):
    """The selection policy of :func:`best_tier` on the HARDWARE preset ``hardware`` (``CostModelPolicy("mi355x")``)."""

    hardware: str

    def __post_init__(self):
        if not isinstance(self.hardware, str) or self.hardware not in HARDWARE:
            raise ValueError(f"hardware: expected one of {sorted(HARDWARE)}, got {self.hardware!r}")

    def select(self, config: TailConfig, num_tokens: int, tp_size: int, *, weight_layout: str | None = None,
               device_kind: str | None = None, platform: str | jax.Device | None = None) -> TierDecision:
        """:func:`best_tier` among the tiers that run compiled on ``platform`` (one_kernel on a GPU platform only);
        ValueError without ``weight_layout``, which the price depends on."""
        platform = check_platform(platform)
        if weight_layout is None:
            raise ValueError('weight_layout: the cost-model selection policy prices the call, so it needs its '
                             'weight layout')
        tiers = [tier for tier in _candidates(config, weight_layout, None)
                 if not tier.record.runs_interpreted_on(platform)]
        decision = best_tier(config, num_tokens, tp_size, hardware=self.hardware, weight_layout=weight_layout,
                             tiers=tiers)
        unlike = unlike_the_rules(config, num_tokens, tp_size, decision.tier, weight_layout=weight_layout,
                                  platform=platform)
        return TierDecision(decision.tier, f"cost model: {decision.rule}{unlike}")


@dataclasses.dataclass(frozen=True)
class Crossover:
    """The fastest predicted tier changes from ``before`` to ``after`` at ``num_tokens`` (``after`` wins there)."""

    num_tokens: int
    before: Tier
    after: Tier


def crossovers(
    config: TailConfig,
    tp_size: int,
    *,
    hardware: Hardware | str,
    weight_layout: str = "replicated",
    tiers: Iterable[Tier | str] | None = None,
    token_range: tuple[int, int] = (1, 16384),
) -> tuple[Crossover, ...]:
    """Every token count in ``token_range`` (inclusive) where :func:`best_tier`'s tier changes, in order; empty
    when one tier is fastest over the range. ValueError naming a bad argument.

    Evaluated at every multiple of p and the count after it (the padding's steps), each change bisected to
    the exact count; a change and its change back inside one block of p, at one_kernel's steps, may hide.
    """
    hardware = hardware_preset(hardware)
    check_config(config)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    candidates = _candidates(config, weight_layout, tiers)
    if (not isinstance(token_range, tuple) or len(token_range) != 2
            or any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in token_range)
            or not 1 <= token_range[0] <= token_range[1]):
        raise ValueError(
            f"token_range: expected a tuple (first, last) of integers with 1 <= first <= last, got {token_range!r}"
        )
    first, last = (int(t) for t in token_range)

    sums = config.sum_plan(tp_size)

    @functools.cache  # the bisections ask again for counts the grid has priced
    def fastest(num_tokens: int) -> Tier:
        return candidates[_first_fastest(_times(config, num_tokens, tp_size, hardware, weight_layout, candidates,
                                                sums))]

    grid = sorted({first, last} | {t for k in range(first // tp_size, last // tp_size + 1)
                                   for t in (k * tp_size, k * tp_size + 1) if first <= t <= last})
    changes = []
    before = fastest(first)
    for start, end in zip(grid, grid[1:], strict=False):
        after = fastest(end)
        if after is not before:
            changes.append(_bisect(fastest, start, before, end))
        before = after
    return tuple(changes)


def _bisect(fastest: Callable[[int], Tier], start: int, before: Tier, end: int) -> Crossover:
    """The first count in (``start``, ``end``] where ``fastest`` differs from ``before``, its tier at ``start``."""
    while end - start > 1:
        middle = (start + end) // 2
        if fastest(middle) is before:
            start = middle
        else:
            end = middle
    return Crossover(end, before, fastest(end))


def _costs(config: TailConfig, num_tokens: int, tp_size: int, weight_layout: str, candidates: list[Tier],
           sums: SumPlan) -> list[TierCost]:
    return [_tier_cost(config, num_tokens, tp_size, tier, weight_layout, sums) for tier in candidates]


def _times(config: TailConfig, num_tokens: int, tp_size: int, hardware: Hardware, weight_layout: str,
           candidates: list[Tier], sums: SumPlan) -> list[float]:
    return [predict_time(cost, hardware).total_s
            for cost in _costs(config, num_tokens, tp_size, weight_layout, candidates, sums)]


def _first_fastest(times: list[float]) -> int:
    """The index of the first time within a relative 1e-9 of the smallest, whichever way rounding tips them."""
    limit = min(times) * (1 + 1e-9)
    return next(index for index, seconds in enumerate(times) if seconds <= limit)


def _candidates(config: TailConfig, weight_layout: str, tiers: Iterable[Tier | str] | None) -> list[Tier]:
    """The tiers to compare, in Tier's order: ``tiers`` validated, or every tier that runs."""
    weight_layout = check_weight_layout(weight_layout)
    if tiers is None:
        return [tier for tier in Tier if tier.supports(weight_layout, config)]
    if isinstance(tiers, (str, Tier)):
        raise ValueError(f"tiers: expected an iterable of tiers, got {tiers!r}")
    chosen = {Tier.parse(tier, argument="tiers") for tier in tiers}
    if not chosen:
        raise ValueError("tiers: expected at least one tier, got none")
    for tier in chosen:
        tier.record.check_runs(weight_layout, config, argument="tiers")
    return [tier for tier in Tier if tier in chosen]
