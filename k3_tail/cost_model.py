"""What each tier costs per rank, how long it should take on a given GPU, and where the tiers cross over.

The model has two layers.

1. **Counts** (:func:`tier_cost`), exact for the program each tier builds: per TP rank, for T tokens,
   hidden size H, latent size L, p ranks, d bytes per element of ``config.dtype`` and the column block
   width Hb = padded_hidden_size(H, p) / p (= H/p when p divides H):

   - ``gemm_flops``: 2*T*L*H for a full projection (native, overlap and one_shot with the replicated
     kernel), else 2*T*L*Hb (own column block).
   - ``weight_bytes``: kernel bytes the GEMM reads (d*L*H or d*L*Hb; a column tier on the replicated
     layout reads only its own block) plus the norm weight (d*L) when ``use_latent_norm``.
   - ``activation_bytes``: the activation rows the tier reads and writes on this rank: its routed and
     shared inputs and its own rows of y, d*(T*L + T*H + T*H) (no shared partial: no second term;
     sequence-parallel output: the last term is T/p*H). This is the traffic no schedule avoids, and for
     a call it equals the per-rank bytes of the program's activation arguments and result;
     intermediates that XLA's fusion decides (the float32 projection of the replicated layout, the
     normalised latent, the column tier's [T, H] buffer) are not counted.
   - ``collectives``: every collective the tier issues, with its buffer as :mod:`k3_tail.xla_report`
     counts it (the reduced buffer of an all-reduce, the input of a reduce-scatter, the gathered
     result of an all-gather, the per-rank send buffer of an all-to-all) and its per-rank ring wire
     bytes: all-reduce 2(p-1)/p * B, reduce-scatter, all-gather and all-to-all (p-1)/p * B.

   Collectives per tier, in issue order (AR all-reduce, RS reduce-scatter, AG all-gather, A2A
   all-to-all; element counts; "hidden": runs beside the GEMM). With sequence-parallel output
   (T % p == 0) every AR(T*H) and AR(T*(2H+L)) below becomes an RS of the same buffer, and
   scatter_gather's final AG becomes A2A(T*Hb):

     native           AR(T*L), [column layout: AG(T*p*Hb)], AR(T*H)
     overlap          AR(T*L), AR(T*H) hidden, [column layout: AG(T*p*Hb)]
     column_parallel  AR(T*L), AR(T*H)
     scatter_gather   AR(T*L), RS(T*p*Hb) hidden, AG(T*p*Hb)
     one_shot         AR(T*(2H+L))

   Without shared experts the shared reduction disappears (native, overlap, scatter_gather; one_shot
   packs T*(H+L)); column_parallel still reduces its [T, H] buffer. Without the latent norm one_shot
   packs no x (T*2H). With ``fused_output_is_reduced`` there is no AR(T*L). With sequence-parallel
   output and p not dividing T, the tier runs on T' = T rounded up to a multiple of p (every figure
   above with T' for T) and an AG of the [T', H] result follows (what :func:`k3_tail.tail_forward`
   does). T = 0 without sequence-parallel output costs nothing: XLA drops the empty collectives.

2. **Time** (:func:`predict_time`) from a roofline for the local work and an alpha-beta model for the
   collectives, with the :class:`Hardware` figures:

       local      = max(gemm_flops / peak_flops, (weight_bytes + activation_bytes) / hbm_bytes_per_s)
       collective = collective_latency_s + wire_bytes / link_bytes_per_s   (0 for a group of 1 rank)
       total      = sum(serial collectives) + max(local, sum(hidden collectives))

   so per tier, with r the latent and s the shared reduction: native and column_parallel =
   AR(r) + local + AR(s) (+ AG); one_shot = local + AR; overlap = AR(r) + max(local, AR(s)) (+ AG);
   scatter_gather = AR(r) + max(local, RS(s)) + AG.

Assumptions a reader must know:
- Vendor peaks: the presets hold data-sheet peak dense BF16 FLOP/s, HBM and link bandwidth, which
  real kernels reach only in part, so predicted times are optimistic; the crossovers depend on the
  ratios between the terms. ``collective_latency_s`` is an
  assumption (10 us), not a vendor figure. Replace any field with a measurement for a real decision:
  ``dataclasses.replace(HARDWARE["mi355x"], collective_latency_s=...)``.
- ``link_bytes_per_s`` is one GPU's bandwidth in one direction over all its links, and a ring
  collective is assumed to drive it fully (AMD's fully connected xGMI node and NVSwitch both let
  every rank send to its peers at that rate).
- Collectives run one at a time; a hidden one shares neither HBM bandwidth nor compute units with
  the GEMM it runs beside. The latent all-reduce always precedes the GEMM.
- Collectives are counted as the tier issues them: on GPU, XLA combines the native tier's two
  all-reduces into one (one latency fewer than modelled).
- A column tier on the replicated layout reads only its own kernel block; XLA on GPU materialises
  that slice as a copy first (another 2*d*L*Hb bytes per call, not counted; the column layout has
  none).
- Elementwise work (norm, adds, casts) costs no FLOPs here; its traffic is in ``activation_bytes``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from types import MappingProxyType

import numpy as np

from k3_tail.columns import check_weight_layout, padded_hidden_size
from k3_tail.config import TailConfig, check_int
from k3_tail.selection import Tier, TierDecision
from k3_tail.sequence_parallel import padded_token_count

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL = "all-reduce", "reduce-scatter", "all-gather", "all-to-all"
# Per-rank ring wire bytes as a multiple of the buffer bytes, given the group size g (as k3_tail.xla_report).
_WIRE_FACTORS = {
    ALL_REDUCE: lambda g: 2 * (g - 1) / g,
    REDUCE_SCATTER: lambda g: (g - 1) / g,
    ALL_GATHER: lambda g: (g - 1) / g,
    ALL_TO_ALL: lambda g: (g - 1) / g,
}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU of a TP group, for :func:`predict_time`.

    peak_flops: dense BF16 FLOP/s of one GPU. hbm_bytes_per_s: its HBM bandwidth (bytes/s).
    link_bytes_per_s: its collective bandwidth, one direction, all links to its TP peers together
    (bytes/s). collective_latency_s: the fixed time of one collective (seconds).
    """

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    collective_latency_s: float

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        for field in ("peak_flops", "hbm_bytes_per_s", "link_bytes_per_s", "collective_latency_s"):
            value = getattr(self, field)
            zero_allowed = field == "collective_latency_s"
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not is_number or value < 0 or (value == 0 and not zero_allowed):
                raise ValueError(f"{field}: expected a finite number {'>=' if zero_allowed else '>'} 0, got {value!r}")


# Assumed, for every preset: no vendor publishes a per-collective latency. 10 us is the order of the
# small-message all-reduce times that nccl-tests / rccl-tests report inside one 8-GPU node.
_ASSUMED_COLLECTIVE_LATENCY_S = 10e-6

HARDWARE = MappingProxyType({
    "mi300x": Hardware(
        "mi300x",
        # AMD Instinct MI300X data sheet (2023): peak BF16 1307.4 TFLOPs dense (2614.9 with sparsity).
        peak_flops=1307.4e12,
        # Same data sheet: 192 GB HBM3, 5.3 TB/s peak memory bandwidth.
        hbm_bytes_per_s=5.3e12,
        # Same data sheet: 7 AMD Infinity Fabric (xGMI) links of 128 GB/s peak bidirectional each, one to
        # each peer of an 8-GPU node: 7 x 64 GB/s = 448 GB/s per GPU per direction.
        link_bytes_per_s=448e9,
        collective_latency_s=_ASSUMED_COLLECTIVE_LATENCY_S,
    ),
    "mi325x": Hardware(
        "mi325x",
        # AMD Instinct MI325X data sheet (2024): peak BF16 1307.4 TFLOPs dense (the MI300X's compute).
        peak_flops=1307.4e12,
        # Same data sheet: 256 GB HBM3E, 6.0 TB/s peak memory bandwidth.
        hbm_bytes_per_s=6.0e12,
        # Same data sheet: 7 Infinity Fabric links of 128 GB/s peak bidirectional: 7 x 64 = 448 GB/s per direction.
        link_bytes_per_s=448e9,
        collective_latency_s=_ASSUMED_COLLECTIVE_LATENCY_S,
    ),
    "mi355x": Hardware(
        "mi355x",
        # AMD Instinct MI355X data sheet (2025): peak BF16 2.5 PFLOPs dense (5.0 with sparsity); 2516.6 TFLOP/s
        # = 256 CUs x 4096 dense BF16 FLOP/clock x 2.4 GHz peak engine clock.
        peak_flops=2516.6e12,
        # Same data sheet: 288 GB HBM3E, 8 TB/s peak memory bandwidth.
        hbm_bytes_per_s=8.0e12,
        # Same data sheet: 7 Infinity Fabric links of 153.6 GB/s peak bidirectional: 7 x 76.8 = 537.6 GB/s
        # per GPU per direction.
        link_bytes_per_s=537.6e9,
        collective_latency_s=_ASSUMED_COLLECTIVE_LATENCY_S,
    ),
    "h200": Hardware(
        "h200",
        # NVIDIA H200 Tensor Core GPU data sheet (2024), SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity,
        # i.e. 989.4 TFLOP/s dense (the dense figure of NVIDIA's H100 SXM white paper; same GH100 and clocks).
        peak_flops=989.4e12,
        # Same data sheet: 141 GB HBM3e, 4.8 TB/s.
        hbm_bytes_per_s=4.8e12,
        # Same data sheet: NVLink 900 GB/s per GPU (bidirectional, fourth-generation NVLink through
        # NVSwitch): 450 GB/s per direction.
        link_bytes_per_s=450e9,
        collective_latency_s=_ASSUMED_COLLECTIVE_LATENCY_S,
    ),
})


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective a tier issues, per rank.

    kind: "all-reduce", "reduce-scatter", "all-gather" or "all-to-all". buffer_bytes: the buffer as
    :class:`k3_tail.xla_report.Collective` ``.bytes`` counts it (reduced buffer, reduce-scatter input,
    gathered result, all-to-all send buffer). group_size: ranks taking part (p). hidden: it runs
    beside the tier's GEMM instead of before or after it.
    """

    kind: str
    buffer_bytes: int
    group_size: int
    hidden: bool = False

    def __post_init__(self):
        _check_kind(self.kind)
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size: expected an integer >= 1, got {self.group_size!r}")

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends on a ring: 2(g-1)/g * B for an all-reduce, (g-1)/g * B otherwise."""
        return _WIRE_FACTORS[self.kind](self.group_size) * self.buffer_bytes


@dataclasses.dataclass(frozen=True)
class TierCost:
    """Per-rank cost of one tail call by one tier (module docstring: formulas).

    gemm_flops: FLOPs of the up projection. weight_bytes: kernel (and norm weight) bytes read.
    activation_bytes: activation input and output bytes. collectives: in the order the tier issues them.
    """

    tier: Tier
    num_tokens: int
    tp_size: int
    weight_layout: str
    gemm_flops: int
    weight_bytes: int
    activation_bytes: int
    collectives: tuple[CollectiveCost, ...]

    def collective_bytes(self, kind: str) -> int:
        """Sum of ``buffer_bytes`` of the collectives of ``kind`` (0 when there is none)."""
        _check_kind(kind)
        return sum(collective.buffer_bytes for collective in self.collectives if collective.kind == kind)


def tier_cost(
    config: TailConfig, num_tokens: int, tp_size: int, *, tier: Tier | str, weight_layout: str = "replicated"
) -> TierCost:
    """The per-rank :class:`TierCost` of ``tier`` for ``num_tokens`` (T) tokens on ``tp_size`` (p) ranks.

    ``weight_layout`` is where the [L, H] kernel lives ("replicated" or "column", as for
    :func:`k3_tail.tail_forward`). Bad arguments, a one_shot tier with the column layout or with
    ``config.fused_output_is_reduced`` (which that tier cannot serve) raise ValueError naming the argument.
    """
    if not isinstance(config, TailConfig):
        raise ValueError(f"config: expected a k3_tail.TailConfig, got {type(config).__name__}")
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    tier = Tier.parse(tier)
    weight_layout = check_weight_layout(weight_layout)
    _check_tier_runs(tier, config, weight_layout, argument="tier")

    element = config.dtype.itemsize
    latent, hidden = config.latent_size, config.hidden_size
    block = padded_hidden_size(hidden, tp_size) // tp_size
    sequence_parallel = config.sequence_parallel
    # The rows the tier works on: sequence-parallel output pads T to a multiple of p (at least p).
    rows = padded_token_count(num_tokens, tp_size) if sequence_parallel else num_tokens
    if rows == 0:
        return TierCost(tier, num_tokens, tp_size, weight_layout, 0, 0, 0, ())
    shared = config.has_shared_experts
    output_rows = rows // tp_size if sequence_parallel else rows
    activation_bytes = element * (rows * latent + (rows * hidden if shared else 0) + output_rows * hidden)
    full_projection = tier in (Tier.NATIVE, Tier.OVERLAP, Tier.ONE_SHOT) and weight_layout == "replicated"
    columns = hidden if full_projection else block
    norm_bytes = element * latent if config.use_latent_norm else 0

    def collective(kind: str, elements: int, *, beside_gemm: bool = False) -> CollectiveCost:
        return CollectiveCost(kind, element * elements, tp_size, hidden=beside_gemm)

    reduce_kind = REDUCE_SCATTER if sequence_parallel else ALL_REDUCE
    latent_reduction = [] if config.fused_output_is_reduced else [collective(ALL_REDUCE, rows * latent)]
    if tier in (Tier.NATIVE, Tier.OVERLAP):
        gather = [collective(ALL_GATHER, rows * tp_size * block)] if weight_layout == "column" else []
        reduction = [collective(reduce_kind, rows * hidden, beside_gemm=tier is Tier.OVERLAP)] if shared else []
        collectives = latent_reduction + (gather + reduction if tier is Tier.NATIVE else reduction + gather)
    elif tier is Tier.COLUMN_PARALLEL:
        collectives = latent_reduction + [collective(reduce_kind, rows * hidden)]
    elif tier is Tier.SCATTER_GATHER:
        scatter = [collective(REDUCE_SCATTER, rows * tp_size * block, beside_gemm=True)] if shared else []
        if sequence_parallel:
            finish = collective(ALL_TO_ALL, rows * block)
        else:
            finish = collective(ALL_GATHER, rows * tp_size * block)
        collectives = latent_reduction + scatter + [finish]
    else:  # ONE_SHOT: the packed [s | (c r g) @ W | c r] buffer
        packed = hidden + (hidden if shared else 0) + (latent if config.use_latent_norm else 0)
        collectives = [collective(reduce_kind, rows * packed)]
    if sequence_parallel and rows != num_tokens:
        # tail_forward gathers the padded token-sharded result: JAX arrays shard evenly only.
        collectives.append(collective(ALL_GATHER, rows * hidden))

    return TierCost(
        tier=tier,
        num_tokens=num_tokens,
        tp_size=tp_size,
        weight_layout=weight_layout,
        gemm_flops=2 * rows * latent * columns,
        weight_bytes=element * latent * columns + norm_bytes,
        activation_bytes=activation_bytes,
        collectives=tuple(collectives),
    )


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted per-call times in seconds (module docstring: formulas).

    compute_s: GEMM FLOPs at peak. memory_s: weight and activation bytes at HBM bandwidth.
    collective_s: all collectives, hidden ones included. total_s: the call, hidden collectives overlapped.
    """

    compute_s: float
    memory_s: float
    collective_s: float
    total_s: float

    @property
    def local_s(self) -> float:
        """The roofline time of the local work: max(compute_s, memory_s)."""
        return max(self.compute_s, self.memory_s)


def predict_time(cost: TierCost, hardware: Hardware | str) -> Prediction:
    """The :class:`Prediction` for ``cost`` on ``hardware`` (a :class:`Hardware` or a key of HARDWARE).

    total = sum(serial collective times) + max(local, sum(hidden collective times)), where local =
    max(gemm_flops / peak_flops, (weight_bytes + activation_bytes) / hbm_bytes_per_s) and a collective
    takes collective_latency_s + wire_bytes / link_bytes_per_s (nothing over a group of one rank).
    """
    if not isinstance(cost, TierCost):
        raise ValueError(f"cost: expected a k3_tail.cost_model.TierCost, got {type(cost).__name__}")
    compute, memory, serial, hidden = _time_terms(cost, _hardware(hardware))
    return Prediction(
        compute_s=compute, memory_s=memory, collective_s=serial + hidden, total_s=serial + max(compute, memory, hidden)
    )


def _time_terms(cost: TierCost, hardware: Hardware) -> tuple[float, float, float, float]:
    """(compute, memory, serial collectives, hidden collectives) seconds of ``cost`` on ``hardware``."""
    serial = hidden = 0.0
    for collective in cost.collectives:
        seconds = 0.0
        if collective.group_size > 1:
            seconds = hardware.collective_latency_s + collective.wire_bytes / hardware.link_bytes_per_s
        if collective.hidden:
            hidden += seconds
        else:
            serial += seconds
    return (
        cost.gemm_flops / hardware.peak_flops,
        (cost.weight_bytes + cost.activation_bytes) / hardware.hbm_bytes_per_s,
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
    on equal times the one first in ``Tier``'s order wins.
    """
    hardware = _hardware(hardware)
    candidates = _candidates(config, weight_layout, tiers)
    times = [
        predict_time(tier_cost(config, num_tokens, tp_size, tier=tier, weight_layout=weight_layout), hardware).total_s
        for tier in candidates
    ]
    ranked = sorted(zip(times, candidates, strict=True), key=lambda pair: pair[0])  # stable: Tier's order on ties
    quoted = ", ".join(f"{tier.value} {seconds * 1e6:.2f} us" for seconds, tier in ranked)
    return TierDecision(
        ranked[0][1],
        f"predicted fastest on {hardware.name} at T={num_tokens}, p={tp_size}, {weight_layout} weights: {quoted}",
    )


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

    Every integer T is evaluated (vectorised: each time term is affine in the rows a tier works on),
    so no change is missed however close two crossovers are. An empty tuple: one tier is fastest
    over the whole range.
    """
    hardware = _hardware(hardware)
    candidates = _candidates(config, weight_layout, tiers)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    if (not isinstance(token_range, tuple) or len(token_range) != 2
            or any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in token_range)
            or not 1 <= token_range[0] <= token_range[1]):
        raise ValueError(
            f"token_range: expected a tuple (first, last) of integers with 1 <= first <= last, got {token_range!r}"
        )
    tokens = np.arange(token_range[0], token_range[1] + 1)
    # Sequence-parallel output runs a tier on T rounded up to a multiple of p; the gather that follows
    # when p does not divide T is the same for every tier, so it cannot change which one is fastest.
    rows = -(-tokens // tp_size) * tp_size if config.sequence_parallel else tokens
    totals = np.stack([_totals(config, tp_size, hardware, weight_layout, tier, rows) for tier in candidates])
    fastest = np.argmin(totals, axis=0)  # the first of equal minima: Tier's order, as best_tier
    return tuple(
        Crossover(int(tokens[index]), candidates[fastest[index - 1]], candidates[fastest[index]])
        for index in np.flatnonzero(fastest[1:] != fastest[:-1]) + 1
    )


def _totals(config, tp_size, hardware, weight_layout, tier, rows: np.ndarray) -> np.ndarray:
    """Predicted total seconds of ``tier`` for each row count in ``rows`` (>= 1), padding gather excluded.

    Every count of :func:`tier_cost` is a fixed part plus a part proportional to the rows (module
    docstring), and so is each of :func:`_time_terms`: two calls, at p and 2p rows (no padding), give
    each term's line.
    """
    first, second = (
        np.array(_time_terms(tier_cost(config, n, tp_size, tier=tier, weight_layout=weight_layout), hardware))
        for n in (tp_size, 2 * tp_size)
    )
    slope = (second - first) / tp_size
    compute, memory, serial, hidden = first[:, None] + slope[:, None] * (rows - tp_size)
    return serial + np.maximum(np.maximum(compute, memory), hidden)


def _check_kind(kind: str) -> None:
    if kind not in _WIRE_FACTORS:
        raise ValueError(f"kind: expected one of {tuple(_WIRE_FACTORS)}, got {kind!r}")


def _hardware(hardware: Hardware | str) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware.strip().lower() in HARDWARE:
        return HARDWARE[hardware.strip().lower()]
    raise ValueError(
        f"hardware: expected a k3_tail.cost_model.Hardware or one of {sorted(HARDWARE)}, got {hardware!r}"
    )


def _check_tier_runs(tier: Tier, config: TailConfig, weight_layout: str, *, argument: str) -> None:
    reason = tier.why_not(weight_layout, config)
    if reason is not None:
        raise ValueError(f"{argument}: {reason}")


def _candidates(config, weight_layout, tiers) -> list[Tier]:
    """The tiers to compare, in Tier's order: ``tiers`` validated, or every tier that runs."""
    if not isinstance(config, TailConfig):
        raise ValueError(f"config: expected a k3_tail.TailConfig, got {type(config).__name__}")
    weight_layout = check_weight_layout(weight_layout)
    if tiers is None:
        return [tier for tier in Tier if tier.supports(weight_layout, config)]
    if isinstance(tiers, (str, Tier)):
        raise ValueError(f"tiers: expected an iterable of tiers, got {tiers!r}")
    chosen = {Tier.parse(tier, argument="tiers") for tier in tiers}
    if not chosen:
        raise ValueError("tiers: expected at least one tier, got none")
    for tier in chosen:
        _check_tier_runs(tier, config, weight_layout, argument="tiers")
    return [tier for tier in Tier if tier in chosen]
