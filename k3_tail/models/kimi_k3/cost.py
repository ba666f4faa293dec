"""What the tail is worth in a Kimi-K3-style latent MoE layer, predicted: a roofline of the layer's
other kernels plus :mod:`k3_tail.selection.cost_model`'s prediction of the tail tier.

Per TP rank, T tokens, p ranks (layer sizes: :class:`MoELayerSizes`), d bytes per activation and weight element
and d_e per routed-expert weight element (d by default; MXFP4: ``mxfp4.MXFP4_BYTES``):

| kernel | FLOPs | bytes |
| --- | --- | --- |
| router | 2THE | d(HE + TH) + 4TE (float32 scores) |
| routed down projection | 2THL | d(HL + TH + TL) |
| routed experts | 6TkLm/p | 3 d_e L m/p per expert read + d Tk(2L + 3m/p) |
| shared experts | 6THF/p | 3dHF/p + dT(2H + 3F/p) |

At T = 1 the router, down projection and shared-expert FLOPs are those of two rows, as the layer multiplies them.
Each kernel takes max(FLOPs / peak_flops, bytes / hbm_bytes_per_s) of the ``cost_model`` hardware preset, one
after the other, none hidden; elementwise work costs nothing. The experts read are those some token chose under
uniform routing, E(1 - (1 - k/E)^T). The tail is ``cost_model.predict_time(cost_model.tier_cost(...))``. With
``early_shared_reduction`` the shared reduction runs beside the router, down projection and routed experts, and
only what of it outlasts them is exposed; without it the tail's tier carries it.
"""

from __future__ import annotations

import dataclasses

from k3_tail.config import TailConfig
from k3_tail.ops.tokens import padded_token_count
from k3_tail.ops.up_projection import gemm_rows
from k3_tail.selection import cost_model
from k3_tail.selection.collective_cost import CollectiveCost
from k3_tail.tiers.registry import Tier


@dataclasses.dataclass(frozen=True)
class MoELayerSizes:
    """A latent MoE layer's sizes (E, k, m, F as :class:`~k3_tail.models.kimi_k3.LayerConfig` names them), and whether
    the shared reduction runs early (``tail.shared_output_is_reduced`` is set to follow it)."""

    tail: TailConfig
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int
    early_shared_reduction: bool = True

    def __post_init__(self):
        tail = dataclasses.replace(self.tail, shared_output_is_reduced=self.early_shared_reduction)
        object.__setattr__(self, "tail", tail)


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """One kernel of the layer on one rank: its FLOPs and the bytes it reads and writes."""

    name: str
    flops: float
    bytes: float

    def seconds(self, hardware: cost_model.Hardware) -> float:
        """max(FLOPs / peak_flops, bytes / hbm_bytes_per_s)."""
        return max(self.flops / hardware.peak_flops, self.bytes / hardware.hbm_bytes_per_s)


def experts_read(config: MoELayerSizes, num_tokens: int) -> float:
    """The expected number of distinct experts T tokens choose under uniform routing, E(1 - (1 - k/E)^T)."""
    experts = config.num_experts
    return experts * (1 - (1 - config.top_k / experts) ** num_tokens)


def layer_kernels(config: MoELayerSizes, num_tokens: int, tp_size: int, *,
                  expert_weight_bytes: float | None = None) -> tuple[KernelCost, ...]:
    """The per-rank cost of every kernel before the tail (the module docstring's table)."""
    t, h, lat, e, k = num_tokens, config.tail.hidden_size, config.tail.latent_size, config.num_experts, config.top_k
    m, f = config.expert_intermediate_size / tp_size, config.shared_intermediate_size / tp_size
    d = config.tail.dtype.itemsize
    d_e = d if expert_weight_bytes is None else expert_weight_bytes
    rows = gemm_rows(t)  # the rows the router, down projection and shared experts multiply
    return (
        KernelCost("router", 2 * rows * h * e, d * (h * e + t * h) + 4 * t * e),
        KernelCost("routed down projection", 2 * rows * h * lat, d * (h * lat + t * h + t * lat)),
        KernelCost("routed experts", 6 * t * k * lat * m,
                   3 * d_e * lat * m * experts_read(config, t) + d * t * k * (2 * lat + 3 * m)),
        KernelCost("shared experts", 6 * rows * h * f, 3 * d * h * f + d * t * (2 * h + 3 * f)),
    )


def layer_flops(config: MoELayerSizes, num_tokens: int, tp_size: int, *, tier: Tier | str,
                weight_layout: str = "replicated") -> float:
    """The layer's useful GEMM FLOPs per rank with the tail ``tier``: :func:`layer_kernels`' and the tail's GEMM."""
    tail = cost_model.tier_cost(config.tail, num_tokens, tp_size, tier=tier, weight_layout=weight_layout)
    return sum(kernel.flops for kernel in layer_kernels(config, num_tokens, tp_size)) + tail.gemm_flops


@dataclasses.dataclass(frozen=True)
class LayerPrediction:
    """The predicted per-call seconds of the layer with one tail tier: ``other_s`` before the tail, ``tail_s``
    for the tail, ``shared_exposed_s`` for what of an early shared reduction the routed work does not hide."""

    tier: Tier
    num_tokens: int
    other_s: float
    tail_s: float
    shared_exposed_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.other_s + self.shared_exposed_s + self.tail_s

    @property
    def tail_share(self) -> float:
        """The tail's part of the layer's time."""
        return self.tail_s / self.total_s


def predict_layer(config: MoELayerSizes, num_tokens: int, tp_size: int, *, tier: Tier | str,
                  hardware: cost_model.Hardware | str, weight_layout: str = "replicated",
                  expert_weight_bytes: float | None = None) -> LayerPrediction:
    """The layer's predicted time with ``tier`` for T = ``num_tokens`` on ``tp_size`` ranks of ``hardware``."""
    hardware = cost_model.HARDWARE[hardware] if isinstance(hardware, str) else hardware
    kernels = {kernel.name: kernel.seconds(hardware)
               for kernel in layer_kernels(config, num_tokens, tp_size, expert_weight_bytes=expert_weight_bytes)}
    exposed = 0.0
    if config.early_shared_reduction and num_tokens:
        routed = sum(seconds for name, seconds in kernels.items() if name != "shared experts")
        exposed = max(0.0, shared_reduction(config, num_tokens, tp_size).seconds(hardware) - routed)
    tail = cost_model.tier_cost(config.tail, num_tokens, tp_size, tier=tier, weight_layout=weight_layout)
    return LayerPrediction(Tier.parse(tier), num_tokens, sum(kernels.values()),
                           cost_model.predict_time(tail, hardware).total_s, exposed)


def shared_reduction(config: MoELayerSizes, num_tokens: int, tp_size: int) -> CollectiveCost:
    """The early shared reduction as ``k3_tail.reduce_shared`` issues it, per rank: AR(T*H), or for
    sequence-parallel output a reduce-scatter of the T'-row padded partial; quantised where the config says."""
    element = config.tail.dtype.itemsize
    kind, rows = cost_model.ALL_REDUCE, num_tokens
    if config.tail.sequence_parallel:
        kind, rows = cost_model.REDUCE_SCATTER, padded_token_count(num_tokens, tp_size)
    nbytes = element * rows * config.tail.hidden_size
    return CollectiveCost(kind, nbytes, tp_size, codec=_codec_name(config.tail, nbytes, tp_size),
                          element_bytes=element)


def best_layer(config: MoELayerSizes, num_tokens: int, tp_size: int, *, hardware: cost_model.Hardware | str,
               weight_layout: str = "replicated", expert_weight_bytes: float | None = None) -> LayerPrediction:
    """The fastest :func:`predict_layer` over the tail tiers that run with ``weight_layout`` (the first in
    ``Tier``'s order on a tie)."""
    predictions = [predict_layer(config, num_tokens, tp_size, tier=tier, hardware=hardware,
                                 weight_layout=weight_layout, expert_weight_bytes=expert_weight_bytes)
                   for tier in Tier if tier.supports(weight_layout, config.tail)]
    return min(predictions, key=lambda prediction: prediction.total_s)


def early_reduction_gain(config: MoELayerSizes, num_tokens: int, tp_size: int, *,
                         hardware: cost_model.Hardware | str, weight_layout: str = "replicated",
                         expert_weight_bytes: float | None = None) -> float:
    """1 - layer(early shared reduction) / layer(shared reduction in the tail), each with its fastest tier."""
    early, late = (best_layer(dataclasses.replace(config, early_shared_reduction=flag), num_tokens, tp_size,
                              hardware=hardware, weight_layout=weight_layout, expert_weight_bytes=expert_weight_bytes)
                   for flag in (True, False))
    return 1 - early.total_s / late.total_s


def layer_gain(config: MoELayerSizes, num_tokens: int, tp_size: int, *, tier: Tier | str,
               hardware: cost_model.Hardware | str, weight_layout: str = "replicated",
               expert_weight_bytes: float | None = None) -> float:
    """1 - layer(tier) / layer(native): the predicted fraction of the layer's time ``tier`` saves."""
    predictions = [predict_layer(config, num_tokens, tp_size, tier=choice, hardware=hardware,
                                 weight_layout=weight_layout, expert_weight_bytes=expert_weight_bytes)
                   for choice in (tier, Tier.NATIVE)]
    return 1 - predictions[0].total_s / predictions[1].total_s


def _codec_name(config: TailConfig, nbytes: int, tp_size: int) -> str | None:
    """The codec a sum of ``nbytes`` over ``tp_size`` ranks travels in under ``config``, or None."""
    codec = config.sum_plan(tp_size).codec_for(nbytes)
    return None if codec is None else codec.name
