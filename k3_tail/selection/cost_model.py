"""What each tier costs per rank, how long it should take on a given GPU, and where the tiers cross over.

The model has two layers.

1. **Counts** (:func:`tier_cost`), exact for the program each tier builds: per TP rank, for T tokens,
   hidden size H, latent size L, p ranks, d bytes per element of ``config.dtype`` and the column block
   width Hb = padded_hidden_size(H, p) / p (= H/p when p divides H):

   - ``gemm_flops``: 2*rows*L*columns, with the tier record's ``gemm_rows`` (T, or T'/p for a tier that
     shards tokens) and ``gemm_columns`` (H when the tier projects all columns with the replicated
     kernel, else its own column block Hb).
   - ``weight_bytes``: kernel bytes the GEMM reads (w*L*H or w*L*Hb; a column tier on the replicated
     layout reads only its own block) plus the norm weight (d*L) when ``use_latent_norm``; w = d, or
     1 for an FP8 ``up_proj_dtype``, whose per-column float32 scales add 4*H (or 4*Hb) bytes.
   - ``activation_bytes``: the activation rows the call reads and writes on this rank: its routed and
     shared inputs and its own rows of y, d*(T*L + T*H + T*H) (no shared partial: no second term;
     token-sharded output: the last term is T'/p*H, T' = ``padded_token_count(T, p)``; a shared output
     that arrives reduced is read as the [T, H] that :func:`k3_tail.tail_forward` takes, or this
     rank's T'/p rows of it for token-sharded output), for the caller's T. This is the traffic no
     schedule avoids, and for
     a call it equals the per-rank bytes of the program's activation arguments and result;
     intermediates that XLA's fusion decides (the float32 projection of the replicated layout, the
     normalised latent, the column tier's [T, H] buffer) are not counted.
   - ``scratch_bytes``: a kernel's own scratch, written and read back once (``TierRecord.scratch_bytes``:
     one_kernel's split of K, the partials of the grid ``fused_grid`` gives it, 0.25-0.53 of its weight
     block at T = 16), twice its bytes.
   - ``collectives``: every collective the tier issues, as a
     :class:`~k3_tail.selection.collective_cost.CollectiveCost`: its buffer as :mod:`k3_tail.xla.report`
     counts it and its per-rank ring wire bytes (all-reduce 2(p-1)/p * B, the others (p-1)/p * B).

   The collectives of each tier, in issue order and with which of them run beside the GEMM, are
   its record's cost terms (``Tier.X.record.collectives`` of a :class:`~k3_tail.tiers.record.CallShape`;
   the README's tier table lists them): the record says how they change without shared experts,
   without the norm, with a reduced routed output or with token-sharded output. With sequence-parallel
   output and p not dividing T, the tier runs on T' = T rounded up to a multiple of p (every figure
   but the inputs' activation bytes with T' for T; a tier that shards tokens always does), and the
   output stays the [T'/p, H] rows of each rank (:func:`k3_tail.latent_moe_tail`): no gather.
   T = 0 without sequence-parallel output costs nothing: XLA drops the empty collectives.

   - ``gpu_kernels``: the GPU kernels the tier's compiled call launches besides its collectives and
     copies, per XLA platform: its record's :class:`~k3_tail.tiers.record.GpuKernelCounts`, counted in
     the compiled programs (one for one_kernel; 3-8 for the XLA tiers at decode).
   - ``grid_programs``: the programs of the tier's own kernel's grid, one_kernel's
     (:func:`k3_tail.ops.fused_launch.fused_grid`: row tiles x column tiles x slabs of K); None for XLA's
     kernels, which XLA sizes to the GPU. ``grid_fill`` = min(1, programs / ``TARGET_PROGRAMS``): the share
     of the GPU the grid keeps busy. Kimi-K3, p = 8: 1 for T <= 47 and 65-89, 784 of 1024 programs at T =
     48-64, 448 at T = 512, as the cap on the split of K bites and then no split is left; p = 16: 1 only to
     T = 16, the default rules' ``one_kernel_max_tokens`` (the grid fills a GPU that far for p = 2 to 16).

2. **Time** (:func:`predict_time`) from a roofline for the local work, an alpha-beta model for the
   collectives and a fixed cost per kernel, with the :class:`Hardware` figures:

       local      = max(gemm_flops / peak, (weight_bytes + activation_bytes + scratch_bytes) / hbm_bytes_per_s)
                    / grid_fill
       collective = collective_latency_s + wire_bytes / link_bytes_per_s   (0 for a group of 1 rank)
       launches   = gpu_kernels (on the preset's platform) * kernel_launch_s
       total      = sum(serial collectives) + max(local, sum(hidden collectives)) + launches

   where peak is the preset's ``peak_fp8_flops`` for a GEMM of two FP8 operands
   (``fp8_activations``) in a format the preset lists in ``fp8_formats``, else ``peak_flops``
   (weight-only FP8 multiplies in ``config.dtype``: it saves bytes, not FLOP time), and a collective
   is hidden when its record term runs beside the GEMM (``beside_gemm``); a sum that travels quantised adds its
   codec's shots and memory passes (:mod:`k3_tail.selection.collective_cost`). A grid of fewer programs than
   ``TARGET_PROGRAMS`` has fewer loads in flight than HBM needs to reach its bandwidth, and fewer
   wavefronts for the matrix units: its kernel runs at ``grid_fill`` of both peaks.

Assumptions a reader must know:
- Vendor peaks: the presets hold data-sheet peak dense BF16 FLOP/s, HBM and link bandwidth, which
  real kernels reach only in part, so predicted times are optimistic; the crossovers depend on the
  ratios between the terms. ``collective_latency_s`` is an assumption (10 us), not a vendor figure,
  and so is ``kernel_launch_s`` (2 us: what fusing one kernel away saved in the one public measurement
  of this tail's kernels, on an MI355X). Replace any field with a measurement for a real decision:
  ``dataclasses.replace(HARDWARE["mi355x"], collective_latency_s=...)``.
- ``link_bytes_per_s`` is one GPU's bandwidth in one direction over all its links, which a ring collective is
  assumed to drive fully (:mod:`k3_tail.selection.collective_cost`).
- Collectives run one at a time; a hidden one shares neither HBM bandwidth nor compute units with
  the GEMM it runs beside. The latent all-reduce always precedes the GEMM.
- Collectives are counted as the tier issues them: on GPU, XLA may combine two independent
  all-reduces into one (one latency fewer than modelled).
- A column tier on the replicated layout reads only its own kernel block; XLA on GPU materialises
  that slice as a copy first (another 2*d*L*Hb bytes per call, not counted; the column layout has
  none).
- Elementwise work (norm, adds, casts) costs no FLOPs here; its traffic is in ``activation_bytes``.
- Every kernel runs at the roofline, one_kernel's Pallas kernel at ``grid_fill`` of it: its tiles are
  sized for decode (at most 64 rows a tile: beyond 64 tokens it reads the weight block once per 64 rows,
  which ``weight_bytes`` counts) and nothing tunes it; no measurement backs its time beyond decode.
  ``TARGET_PROGRAMS`` (1024) is where a grid fills a GPU on every preset (AMD's MI300X tuning guide's
  figure), and below it the share is taken as proportional (loads in flight grow with the programs).
- The kernels it saves are what keep one_kernel fastest past ``one_kernel_max_tokens``: column_parallel
  launches 3 (CUDA) or 4 (ROCm) more beyond one token (6-8 us at the assumed 2 us each), which its
  unfilled grid and its weight reads per 64 rows outweigh only at T of a few hundred
  (:class:`CostModelPolicy`'s reason says so where it departs from the default rules).
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
    """Per-rank cost of one tail call by one tier (module docstring: formulas).

    gemm_flops: FLOPs of the up projection. weight_bytes: kernel (and norm weight) bytes read.
    activation_bytes: activation input and output bytes. scratch_bytes: a kernel's scratch traffic (written,
    then read). collectives: in the order the tier issues them.
    fp8_gemm: the FP8 format of both GEMM operands (``fp8_activations``), else None. gpu_kernels: the GPU
    kernels the call launches, by XLA platform ("cuda", "rocm"). grid_programs: the programs of the tier's own
    kernel's grid (one_kernel's), None where XLA sizes the kernels.
    """

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
        """The share of the GPU its kernel keeps busy: min(1, grid_programs / TARGET_PROGRAMS); 1 for XLA's
        kernels and for a call with no work."""
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
    """The per-rank :class:`TierCost` of ``tier`` for ``num_tokens`` (T) tokens on ``tp_size`` (p) ranks.

    ``weight_layout`` is where the [L, H] kernel lives ("replicated" or "column", as for
    :func:`k3_tail.tail_forward`). Bad arguments, or a tier whose record says it cannot run with the
    layout or config, raise ValueError naming the argument.
    """
    check_config(config)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    tier = Tier.parse(tier)
    weight_layout = check_weight_layout(weight_layout)
    tier.record.check_runs(weight_layout, config)
    return _tier_cost(config, num_tokens, tp_size, tier, weight_layout, config.sum_plan(tp_size))


def _tier_cost(config: TailConfig, num_tokens: int, tp_size: int, tier: Tier, weight_layout: str,
               sums: SumPlan) -> TierCost:
    """:func:`tier_cost` of checked arguments, the sums travelling as ``sums`` says."""
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
        scratch_bytes=0 if record.scratch_bytes is None else 2 * record.scratch_bytes(config, rows, tp_size),
        grid_programs=_grid_programs(config, tier, rows, tp_size),
    )


def _grid_programs(config: TailConfig, tier: Tier, rows: int, tp_size: int) -> int | None:
    """The programs of ``tier``'s own kernel's grid for ``rows`` token rows (its record's ``launch_grid``); None for
    the tiers whose kernels XLA sizes."""
    if tier.record.launch_grid is None or rows == 0:
        return None
    return tier.record.launch_grid(config, rows, tp_size).programs


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted per-call times in seconds (module docstring: formulas).

    compute_s: GEMM FLOPs at peak. memory_s: weight, activation and scratch bytes at HBM bandwidth; both at
    the cost's ``grid_fill`` of the peak. collective_s: all collectives, hidden ones included. launch_s: the
    kernels' fixed costs. total_s: the call, hidden collectives overlapped.
    """

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
    """The :class:`Prediction` for ``cost`` on ``hardware`` (a :class:`Hardware` or a key of HARDWARE).

    total = sum(serial collective times) + max(local, sum(hidden collective times)) + launches, where
    local = max(gemm_flops / peak, (weight_bytes + activation_bytes + scratch_bytes) / hbm_bytes_per_s)
    / grid_fill (peak: the preset's FP8 peak for a GEMM of two FP8 operands in a format it multiplies, else
    its BF16 peak), a collective takes collective_latency_s + wire_bytes / link_bytes_per_s (nothing over a
    group of one rank) and launches = gpu_kernels on the preset's platform * kernel_launch_s.
    """
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
    """The tier with the smallest predicted time for this call, and a reason quoting the predictions.

    ``tiers`` (default: every tier that runs with ``config`` and ``weight_layout``) are the candidates;
    on equal times (within a relative 1e-9, whichever way rounding tips them) the one first in
    ``Tier``'s order wins. Bad arguments raise ValueError naming the argument.
    """
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
    """The selection policy that picks the tier :func:`best_tier` predicts fastest on the HARDWARE preset
    named ``hardware`` (``TailConfig(selection_policy=CostModelPolicy("mi355x"))``)."""

    hardware: str

    def __post_init__(self):
        if not isinstance(self.hardware, str) or self.hardware not in HARDWARE:
            raise ValueError(f"hardware: expected one of {sorted(HARDWARE)}, got {self.hardware!r}")

    def select(self, config: TailConfig, num_tokens: int, tp_size: int, *, weight_layout: str | None = None,
               device_kind: str | None = None, platform: str | jax.Device | None = None) -> TierDecision:
        """:func:`best_tier` among every tier that runs, compiled, on ``platform`` (as :func:`k3_tail.select_tier`
        takes it; one_kernel only on a GPU platform: elsewhere, or with the platform unknown, its kernel would
        run interpreted); ValueError without ``weight_layout``, which the price depends on."""
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
    """Every token count in ``token_range`` (inclusive) where :func:`best_tier`'s tier changes, in order.

    The fastest tier is evaluated on a grid of every multiple of p and the count after it, and each
    change between two grid points is bisected to the exact count. That grid follows the padding: a
    tier that works on T rounded up to a multiple of p (token_parallel; every tier with
    sequence-parallel output) costs the same over a block of p counts but for the activation bytes,
    while the others grow smoothly but for one_kernel, whose weight reads step where its row tiles do
    (every ``rows_per_weight_read`` = 64 rows: grid points wherever p divides 64) and whose grid's fill
    steps where its row tiles or its split of K change. Inside a block without such a step the fastest
    tier changes at most once; a block holding one may hide a change and its change back (the tests find
    none against best_tier at every T to 2048). An empty tuple: one tier is fastest over the whole range.
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
    """The first count in (``start``, ``end``] where ``fastest`` differs from ``before`` (its tier at
    ``start``; it differs at ``end``)."""
    while end - start > 1:
        middle = (start + end) // 2
        if fastest(middle) is before:
            start = middle
        else:
            end = middle
    return Crossover(end, before, fastest(end))


def _costs(config: TailConfig, num_tokens: int, tp_size: int, weight_layout: str, candidates: list[Tier],
           sums: SumPlan) -> list[TierCost]:
    """The :class:`TierCost` of each candidate tier for the call."""
    return [_tier_cost(config, num_tokens, tp_size, tier, weight_layout, sums) for tier in candidates]


def _times(config: TailConfig, num_tokens: int, tp_size: int, hardware: Hardware, weight_layout: str,
           candidates: list[Tier], sums: SumPlan) -> list[float]:
    """The predicted total seconds of each candidate tier for the call."""
    return [predict_time(cost, hardware).total_s
            for cost in _costs(config, num_tokens, tp_size, weight_layout, candidates, sums)]


def _first_fastest(times: list[float]) -> int:
    """The index of the first time within a relative 1e-9 of the smallest: ties go to the earlier tier
    whichever way rounding tips them."""
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
