"""What the tail is worth in the Kimi-K3 latent MoE layer, predicted: a roofline of the layer's other
kernels plus ``k3_tail.cost_model``'s prediction of the tail tier.

Per TP rank, T tokens, p ranks, d bytes per activation and weight element (the config's dtype) and
d_e per routed-expert weight element (d by default; Kimi-K3's released checkpoint stores the routed
experts in MXFP4, ``MXFP4_BYTES`` = 4.25 bits: 4-bit values and one 8-bit scale per 32):

| kernel | FLOPs | bytes |
| --- | --- | --- |
| router | 2THE | d(HE + TH) + 4TE (float32 scores) |
| routed down projection | 2THL | d(HL + TH + TL) |
| routed experts | 6TkLm/p | 3 d_e L m/p per expert read + d Tk(2L + 3m/p) |
| shared experts | 6THF/p | 3dHF/p + dT(2H + 3F/p) |

Each kernel takes max(FLOPs / peak_flops, bytes / hbm_bytes_per_s) of the ``k3_tail.cost_model``
hardware preset, one after the other (no overlap between them, none of them hidden behind a
collective); they issue no collective. The experts read are those some token chose: with uniform
routing E(1 - (1 - k/E)^T) of the E (a grouped GEMM reads each once; the CPU and, in jax 0.10.2,
the CUDA lowering of ``jax.lax.ragged_dot`` instead compute every group densely: see
examples/kimi_k3_moe_layer.py). The tail is ``cost_model.predict_time(cost_model.tier_cost(...))``:
its roofline and alpha-beta collectives, with the assumptions its docstring lists. Elementwise work
(SiTU, the top-k, the sort) costs nothing here.

The layer-level gain of a tier is 1 - layer(tier) / layer(native) for the same T: the MoE layer
only, not a whole model's step (attention, the other layers, sampling and scheduling dilute it).
"""

from __future__ import annotations

import dataclasses

import k3_tail
from k3_tail import cost_model

from examples.kimi_k3_moe_layer import LayerConfig

MXFP4_BYTES = 4.25 / 8


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """One kernel of the layer on one rank: its FLOPs and the bytes it reads and writes."""

    name: str
    flops: float
    bytes: float

    def seconds(self, hardware: cost_model.Hardware) -> float:
        """max(FLOPs / peak_flops, bytes / hbm_bytes_per_s)."""
        return max(self.flops / hardware.peak_flops, self.bytes / hardware.hbm_bytes_per_s)


def experts_read(config: LayerConfig, num_tokens: int) -> float:
    """The expected number of distinct experts T tokens choose under uniform routing, E(1 - (1 - k/E)^T)."""
    experts = config.num_experts
    return experts * (1 - (1 - config.top_k / experts) ** num_tokens)


def layer_kernels(config: LayerConfig, num_tokens: int, tp_size: int, *,
                  expert_weight_bytes: float | None = None) -> tuple[KernelCost, ...]:
    """The per-rank cost of every kernel before the tail (the module docstring's table)."""
    t, h, lat, e, k = num_tokens, config.hidden_size, config.latent_size, config.num_experts, config.top_k
    m, f = config.expert_intermediate_size / tp_size, config.shared_intermediate_size / tp_size
    d = config.dtype.itemsize
    d_e = d if expert_weight_bytes is None else expert_weight_bytes
    return (
        KernelCost("router", 2 * t * h * e, d * (h * e + t * h) + 4 * t * e),
        KernelCost("routed down projection", 2 * t * h * lat, d * (h * lat + t * h + t * lat)),
        KernelCost("routed experts", 6 * t * k * lat * m,
                   3 * d_e * lat * m * experts_read(config, t) + d * t * k * (2 * lat + 3 * m)),
        KernelCost("shared experts", 6 * t * h * f, 3 * d * h * f + d * t * (2 * h + 3 * f)),
    )


@dataclasses.dataclass(frozen=True)
class LayerPrediction:
    """The predicted per-call seconds of the layer with one tail tier: ``other_s`` for the kernels
    before the tail (:func:`layer_kernels`), ``tail_s`` for the tail."""

    tier: k3_tail.Tier
    num_tokens: int
    other_s: float
    tail_s: float

    @property
    def total_s(self) -> float:
        return self.other_s + self.tail_s

    @property
    def tail_share(self) -> float:
        """The tail's part of the layer's time."""
        return self.tail_s / self.total_s


def predict_layer(config: LayerConfig, num_tokens: int, tp_size: int, *, tier: k3_tail.Tier | str,
                  hardware: cost_model.Hardware | str, weight_layout: str = "replicated",
                  expert_weight_bytes: float | None = None) -> LayerPrediction:
    """The layer's predicted time with ``tier`` for T = ``num_tokens`` on ``tp_size`` ranks of ``hardware``."""
    hardware = cost_model.HARDWARE[hardware] if isinstance(hardware, str) else hardware
    other = sum(kernel.seconds(hardware)
                for kernel in layer_kernels(config, num_tokens, tp_size, expert_weight_bytes=expert_weight_bytes))
    tail = cost_model.tier_cost(config.tail, num_tokens, tp_size, tier=tier, weight_layout=weight_layout)
    return LayerPrediction(k3_tail.Tier.parse(tier), num_tokens, other, cost_model.predict_time(tail, hardware).total_s)


def layer_gain(config: LayerConfig, num_tokens: int, tp_size: int, *, tier: k3_tail.Tier | str,
               hardware: cost_model.Hardware | str, weight_layout: str = "replicated",
               expert_weight_bytes: float | None = None) -> float:
    """1 - layer(tier) / layer(native): the predicted fraction of the layer's time ``tier`` saves."""
    predictions = [predict_layer(config, num_tokens, tp_size, tier=choice, hardware=hardware,
                                 weight_layout=weight_layout, expert_weight_bytes=expert_weight_bytes)
                   for choice in (tier, k3_tail.Tier.NATIVE)]
    return 1 - predictions[0].total_s / predictions[1].total_s
