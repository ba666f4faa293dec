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
     token-sharded output: the last term is T/p*H; a shared output that arrives reduced is read as
     the [T, H] that :func:`k3_tail.tail_forward` takes, or this rank's T/p rows of it for
     token-sharded output), for the caller's T. This is the traffic no
     schedule avoids, and for
     a call it equals the per-rank bytes of the program's activation arguments and result;
     intermediates that XLA's fusion decides (the float32 projection of the replicated layout, the
     normalised latent, the column tier's [T, H] buffer) are not counted.
   - ``collectives``: every collective the tier issues, with its buffer as :mod:`k3_tail.xla.report`
     counts it (the reduced buffer of an all-reduce, the input of a reduce-scatter, the gathered
     result of an all-gather, the per-rank send buffer of an all-to-all) and its per-rank ring wire
     bytes: all-reduce 2(p-1)/p * B, reduce-scatter, all-gather and all-to-all (p-1)/p * B.

   The collectives of each tier, in issue order and with which of them run beside the GEMM, are
   its record's cost terms (``Tier.X.record.collectives`` of a :class:`~k3_tail.tiers.record.CallShape`;
   the README's tier table lists them): the record says how they change without shared experts,
   without the norm, with a reduced routed output or with token-sharded output. With sequence-parallel
   output and p not dividing T, the tier runs on T' = T rounded up to a multiple of p (every figure
   but the activation bytes with T' for T; a tier that shards tokens always does) and an AG of the
   [T', H] result follows (what :func:`k3_tail.latent_moe_tail`
   does). T = 0 without sequence-parallel output costs nothing: XLA drops the empty collectives.

2. **Time** (:func:`predict_time`) from a roofline for the local work and an alpha-beta model for the
   collectives, with the :class:`Hardware` figures:

       local      = max(gemm_flops / peak, (weight_bytes + activation_bytes) / hbm_bytes_per_s)
       collective = collective_latency_s + wire_bytes / link_bytes_per_s   (0 for a group of 1 rank)
       total      = sum(serial collectives) + max(local, sum(hidden collectives))

   where peak is the preset's ``peak_fp8_flops`` for a GEMM of two FP8 operands
   (``fp8_activations``) in a format the preset lists in ``fp8_formats``, else ``peak_flops``
   (weight-only FP8 multiplies in ``config.dtype``: it saves bytes, not FLOP time), and a collective
   is hidden when its record term runs beside the GEMM (``beside_gemm``).

   A sum that travels quantised (``TailConfig.all_reduce_quantization``, inside its size window:
   :mod:`k3_tail.ops.collectives`; ``CollectiveCost.codec``) moves its encoded chunks instead (b/16 +
   1/32 of a bf16 buffer, padded to whole blocks), pays one latency per shot (two for an all-reduce,
   one for a reduce-scatter) and adds the codec's memory passes at HBM bandwidth (encode, decode and
   sum, and for an all-reduce re-encode and decode: 2B + 3Q + Q/p bytes for a buffer of B bytes whose
   encoded size is Q).

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
- Collectives are counted as the tier issues them: on GPU, XLA may combine two independent
  all-reduces into one (one latency fewer than modelled).
- A column tier on the replicated layout reads only its own kernel block; XLA on GPU materialises
  that slice as a copy first (another 2*d*L*Hb bytes per call, not counted; the column layout has
  none).
- Elementwise work (norm, adds, casts) costs no FLOPs here; its traffic is in ``activation_bytes``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from k3_tail._checks import check_int
from k3_tail.config import TailConfig, check_config
from k3_tail.selection.decision import TierDecision
from k3_tail.hardware import HARDWARE, Hardware, hardware_preset
from k3_tail.ops.codecs import CODECS
from k3_tail.ops.columns import check_weight_layout
from k3_tail.tiers.record import (
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, RING_WIRE_FACTORS, SUM_KINDS, CallShape,
)
from k3_tail.tiers.registry import Tier
from k3_tail.ops.tokens import padded_token_count
from k3_tail.tiers.context import is_token_sharded_output
from k3_tail.ops.up_projection import gemm_rows

__all__ = [
    "ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "HARDWARE", "REDUCE_SCATTER", "CollectiveCost", "Crossover", "Hardware",
    "Prediction", "TierCost", "best_tier", "crossovers", "predict_time", "tier_cost",
]


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective a tier issues, per rank.

    kind: "all-reduce", "reduce-scatter", "all-gather" or "all-to-all". buffer_bytes: the buffer as
    :class:`k3_tail.xla.report.Collective` ``.bytes`` counts it (reduced buffer, reduce-scatter input,
    gathered result, all-to-all send buffer). group_size: ranks taking part (p). hidden: it runs
    beside the tier's GEMM instead of before or after it. codec: for a sum (all-reduce or
    reduce-scatter) that travels quantised (:mod:`k3_tail.ops.collectives`), the codec's name, else
    None; element_bytes: the bytes of one element of the buffer, from which the encoded size follows.
    """

    kind: str
    buffer_bytes: int
    group_size: int
    hidden: bool = False
    codec: str | None = None
    element_bytes: int = 2

    def __post_init__(self):
        _check_kind(self.kind)
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size: expected an integer >= 1, got {self.group_size!r}")
        if self.codec is not None and (self.codec not in CODECS or self.kind not in SUM_KINDS):
            raise ValueError(f"codec: expected one of {tuple(CODECS)} on an all-reduce or reduce-scatter, got "
                             f"{self.codec!r} on a {self.kind}")

    @property
    def payload_bytes(self) -> int:
        """Bytes of the buffer as it travels: ``buffer_bytes``, or its p encoded chunks when quantised."""
        return int(_payload_bytes(self.codec, self.buffer_bytes, self.element_bytes, self.group_size))

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends on a ring: 2(g-1)/g * B for an all-reduce, (g-1)/g * B otherwise, with B
        the payload (a quantised all-reduce's two shots move (g-1)/g of its encoded chunks each)."""
        return RING_WIRE_FACTORS[self.kind](self.group_size) * self.payload_bytes

    def seconds(self, hardware: Hardware | str) -> float:
        """collective_latency_s per collective (two for a quantised all-reduce) + wire_bytes /
        link_bytes_per_s + the codec's memory passes at HBM bandwidth on ``hardware``; 0 over a group
        of one rank."""
        return float(_collective_seconds(self.kind, self.buffer_bytes, self.group_size, self.codec,
                                         self.element_bytes, hardware_preset(hardware)))


@dataclasses.dataclass(frozen=True)
class TierCost:
    """Per-rank cost of one tail call by one tier (module docstring: formulas).

    gemm_flops: FLOPs of the up projection. weight_bytes: kernel (and norm weight) bytes read.
    activation_bytes: activation input and output bytes. collectives: in the order the tier issues them.
    fp8_gemm: the FP8 format of both GEMM operands (``fp8_activations``), else None.
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

    def collective_bytes(self, kind: str) -> int:
        """Sum of ``buffer_bytes`` of the collectives of ``kind`` (0 when there is none)."""
        _check_kind(kind)
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

    element = config.dtype.itemsize
    latent, hidden = config.latent_size, config.hidden_size
    sequence_parallel = config.sequence_parallel
    record = tier.record
    # The rows the tier works on: sequence-parallel output, and a tier that shards tokens itself, pad T
    # to a multiple of p (at least p).
    padded = sequence_parallel or record.shards_tokens
    rows = padded_token_count(num_tokens, tp_size) if padded else num_tokens
    if num_tokens == 0 and not sequence_parallel:
        return TierCost(tier, num_tokens, tp_size, weight_layout, 0, 0, 0, ())
    shape = CallShape(
        rows=rows, latent_size=latent, hidden_size=hidden, tp_size=tp_size, weight_layout=weight_layout,
        has_shared=config.has_shared_experts, use_norm=config.use_latent_norm,
        routed_reduced=config.fused_output_is_reduced, token_sharded=sequence_parallel,
        shared_reduced=config.shared_output_is_reduced,
    )
    token_sharded = is_token_sharded_output(config, num_tokens, tp_size)
    output_rows = num_tokens // tp_size if token_sharded else num_tokens
    shared_rows = num_tokens if shape.has_shared else 0
    if shape.shared_reduced and token_sharded:
        shared_rows = output_rows  # this rank's rows of the reduced [T, H], sharded over tokens
    activation_bytes = element * (num_tokens * latent + shared_rows * hidden + output_rows * hidden)
    columns = record.gemm_columns(hidden, tp_size, weight_layout)
    norm_bytes = element * latent if config.use_latent_norm else 0
    if config.up_proj_dtype is None:
        kernel_bytes = element * latent * columns
    else:  # FP8 values and one float32 scale per column
        kernel_bytes = config.up_proj_dtype.itemsize * latent * columns + 4 * columns
    collectives = [
        CollectiveCost(term.kind, element * term.elements, tp_size, hidden=term.beside_gemm,
                       codec=_codec_name(config, term.kind, element * term.elements, tp_size), element_bytes=element)
        for term in tier.record.collectives(shape)
    ]
    if sequence_parallel and not token_sharded:
        # latent_moe_tail gathers the padded token-sharded result: JAX arrays shard evenly only.
        collectives.append(CollectiveCost(ALL_GATHER, element * rows * hidden, tp_size))

    return TierCost(
        tier=tier,
        num_tokens=num_tokens,
        tp_size=tp_size,
        weight_layout=weight_layout,
        gemm_flops=2 * gemm_rows(record.gemm_rows(rows, tp_size)) * latent * columns,
        weight_bytes=kernel_bytes + norm_bytes,
        activation_bytes=activation_bytes,
        collectives=tuple(collectives),
        fp8_gemm=config.up_proj_dtype.name if config.fp8_activations else None,
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
    max(gemm_flops / peak, (weight_bytes + activation_bytes) / hbm_bytes_per_s) (peak: the preset's
    FP8 peak for a GEMM of two FP8 operands in a format it multiplies, else its BF16 peak) and a collective
    takes collective_latency_s + wire_bytes / link_bytes_per_s (nothing over a group of one rank).
    """
    if not isinstance(cost, TierCost):
        raise ValueError(f"cost: expected a k3_tail.selection.cost_model.TierCost, got {type(cost).__name__}")
    compute, memory, serial, hidden = _time_terms(cost, hardware_preset(hardware))
    return Prediction(
        compute_s=compute, memory_s=memory, collective_s=serial + hidden, total_s=serial + max(compute, memory, hidden)
    )


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
        cost.gemm_flops / peak,
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
    hardware = hardware_preset(hardware)
    candidates = _candidates(config, weight_layout, tiers)
    times = [
        predict_time(tier_cost(config, num_tokens, tp_size, tier=tier, weight_layout=weight_layout), hardware).total_s
        for tier in candidates
    ]
    ranked = sorted(zip(times, candidates, strict=True), key=lambda pair: pair[0])
    quoted = ", ".join(f"{tier.value} {seconds * 1e6:.2f} us" for seconds, tier in ranked)
    return TierDecision(
        candidates[_first_fastest(np.array(times)[:, None])[0]],
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
    hardware = hardware_preset(hardware)
    candidates = _candidates(config, weight_layout, tiers)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    if (not isinstance(token_range, tuple) or len(token_range) != 2
            or any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in token_range)
            or not 1 <= token_range[0] <= token_range[1]):
        raise ValueError(
            f"token_range: expected a tuple (first, last) of integers with 1 <= first <= last, got {token_range!r}"
        )
    tokens = np.arange(token_range[0], token_range[1] + 1)
    # With sequence-parallel output the gather that follows when p does not divide T is the same for
    # every tier, so it cannot change which one is fastest.
    totals = np.stack([_totals(config, tp_size, hardware, weight_layout, tier, tokens) for tier in candidates])
    fastest = _first_fastest(totals)
    return tuple(
        Crossover(int(tokens[index]), candidates[fastest[index - 1]], candidates[fastest[index]])
        for index in np.flatnonzero(fastest[1:] != fastest[:-1]) + 1
    )


def _totals(config, tp_size, hardware, weight_layout, tier, tokens: np.ndarray) -> np.ndarray:
    """Predicted total seconds of ``tier`` for each token count in ``tokens`` (>= 1), padding gather excluded.

    Every count of :func:`tier_cost` is a fixed part plus a part proportional to the rows the tier
    works on (T, or T rounded up to a multiple of p for sequence-parallel output and for a tier that
    shards tokens), except the activation bytes, which follow the caller's T and, with
    sequence-parallel output, whether the result comes back token-sharded (p divides T) or gathered.
    So is each of :func:`_time_terms`: two calls p tokens apart give each term's line, taken where the
    GEMM has at least two rows; the GEMM of a single row is computed as two (its compute term doubles).
    """
    def costs(start: int) -> tuple[TierCost, TierCost]:
        return tuple(tier_cost(config, n, tp_size, tier=tier, weight_layout=weight_layout)
                     for n in (start, start + tp_size))

    def lines(start: int) -> tuple[np.ndarray, np.ndarray]:
        first, second = (np.array(_time_terms(cost, hardware)) for cost in costs(start))
        return first - (second - first) / tp_size * start, (second - first) / tp_size  # intercept, slope

    intercept, slope = lines(2 * tp_size)
    record = Tier.parse(tier).record
    padded = config.sequence_parallel or record.shards_tokens
    rows = -(-tokens // tp_size) * tp_size if padded else tokens
    compute = intercept[0] + slope[0] * rows
    serial, hidden = _collective_totals(config, hardware, costs(2 * tp_size), rows)
    compute = compute * np.where(record.gemm_rows(rows, tp_size) == 1, gemm_rows(1), 1)
    memory = intercept[1] + slope[1] * tokens
    if config.sequence_parallel and tp_size > 1:  # T not divisible by p: all T rows of y come back
        gathered_intercept, gathered_slope = lines(tp_size + 1)
        memory = np.where(tokens % tp_size != 0, gathered_intercept[1] + gathered_slope[1] * tokens, memory)
    return serial + np.maximum(np.maximum(compute, memory), hidden)


def _collective_totals(config: TailConfig, hardware: Hardware, costs: tuple[TierCost, TierCost],
                       rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(serial, hidden) collective seconds of a tier for each row count in ``rows``, from ``costs`` at two
    row counts p apart: each buffer is affine in the rows, and its time follows from its size, through
    the quantisation window when the config has one (which makes it piecewise)."""
    first, second = costs
    tp_size = first.tp_size
    plan = config.sum_plan(tp_size)
    serial = hidden = np.zeros(rows.shape)
    for start, later in zip(first.collectives, second.collectives, strict=True):
        per_row = (later.buffer_bytes - start.buffer_bytes) // tp_size
        nbytes = start.buffer_bytes + per_row * (rows - 2 * tp_size)
        seconds = _collective_seconds(start.kind, nbytes, tp_size, None, start.element_bytes, hardware)
        if plan.codec is not None and start.kind in SUM_KINDS:
            smallest, largest = plan.quantized_bytes
            quantized = _collective_seconds(start.kind, nbytes, tp_size, plan.codec.name, start.element_bytes,
                                            hardware)
            seconds = np.where((smallest <= nbytes) & (nbytes <= largest), quantized, seconds)
        if start.hidden:
            hidden = hidden + seconds
        else:
            serial = serial + seconds
    return serial, hidden


def _first_fastest(totals: np.ndarray) -> np.ndarray:
    """Per column of ``totals`` [tiers, cases], the first tier (Tier's order) within a relative 1e-9 of
    the fastest: ties go to the earlier tier whichever way rounding tips them."""
    return np.argmax(totals <= totals.min(axis=0) * (1 + 1e-9), axis=0)


def _codec_name(config: TailConfig, kind: str, nbytes: int, tp_size: int) -> str | None:
    """The codec a collective of ``kind`` over ``nbytes`` travels in: sums only, as the tiers decide it."""
    codec = config.sum_plan(tp_size).codec_for(nbytes) if kind in SUM_KINDS else None
    return None if codec is None else codec.name


def _payload_bytes(codec: str | None, buffer_bytes, element_bytes: int, group_size: int):
    """Bytes of a buffer as it travels (numpy arrays too): as it is, or its p chunks encoded, each
    chunk 1/p of the elements rounded up and padded to whole blocks."""
    if codec is None:
        return buffer_bytes
    chunk = -(-(buffer_bytes // element_bytes) // group_size)
    return group_size * CODECS[codec].encoded_bytes(chunk)


def _collective_seconds(kind: str, buffer_bytes, group_size: int, codec: str | None, element_bytes: int,
                        hardware: Hardware):
    """:meth:`CollectiveCost.seconds`, for ``buffer_bytes`` a number or a numpy array.

    A quantised sum adds the codec's memory passes: encode (read B, write the payload Q), decode and
    sum the received chunks (read Q), then for an all-reduce re-encode the own chunk (write Q/p) and
    decode what the all-gather brought (read Q, write B); a reduce-scatter writes its B/p chunk.
    """
    if group_size == 1:
        return 0.0 * buffer_bytes
    payload = _payload_bytes(codec, buffer_bytes, element_bytes, group_size)
    wire = RING_WIRE_FACTORS[kind](group_size) * payload
    if codec is None:
        return hardware.collective_latency_s + wire / hardware.link_bytes_per_s
    if kind == ALL_REDUCE:
        shots, passes = 2, 2 * buffer_bytes + 3 * payload + payload / group_size
    else:
        shots, passes = 1, buffer_bytes + buffer_bytes / group_size + 2 * payload
    return (shots * hardware.collective_latency_s + wire / hardware.link_bytes_per_s
            + passes / hardware.hbm_bytes_per_s)


def _check_kind(kind: str) -> None:
    if kind not in RING_WIRE_FACTORS:
        raise ValueError(f"kind: expected one of {tuple(RING_WIRE_FACTORS)}, got {kind!r}")


def _candidates(config, weight_layout, tiers) -> list[Tier]:
    """The tiers to compare, in Tier's order: ``tiers`` validated, or every tier that runs."""
    check_config(config)
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
