"""The Kimi-K3 latent MoE layer's shapes: :class:`LayerConfig`, with Kimi-K3's own widths and counts."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import k3_tail
from k3_tail.models.kimi_k3 import mxfp4
from k3_tail.models.kimi_k3.cost import MoELayerSizes
from k3_tail.models.kimi_k3.routed_experts import ROUTED_EXPERTS

KIMI_K3_NUM_EXPERTS, KIMI_K3_TOP_K = 896, 16
# LayerConfig.expert_quantization's values: None (experts in the layer's dtype) or MXFP4.
EXPERT_QUANTIZATIONS = (None, "mxfp4")
KIMI_K3_EXPERT_INTERMEDIATE_SIZE, KIMI_K3_SHARED_INTERMEDIATE_SIZE = 3072, 6144


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The layer's shapes (frozen, hashable); ``tail`` holds H, L, the norm's eps, c, the dtype and the switches.

    E = ``num_experts`` routed experts of width m = ``expert_intermediate_size``, k = ``top_k`` per token; shared
    experts of width F = ``shared_intermediate_size``; p must divide m and F. ``routed_experts``: the method every
    call takes (a key of ``ROUTED_EXPERTS``), or None to pick by T. ``early_shared_reduction``: the shared partials
    summed while the routed experts compute (``tail.shared_output_is_reduced`` follows it), else inside the tail.
    ``expert_quantization``: None, or "mxfp4" (held packed; L and m multiples of 32, a bfloat16 or float32 dtype).
    ValueError naming the field for a bad value.
    """

    tail: k3_tail.TailConfig
    num_experts: int = 8
    top_k: int = 2
    expert_intermediate_size: int = KIMI_K3_EXPERT_INTERMEDIATE_SIZE
    shared_intermediate_size: int = KIMI_K3_SHARED_INTERMEDIATE_SIZE
    routed_experts: str | None = None
    early_shared_reduction: bool = True
    expert_quantization: str | None = None

    def __post_init__(self):
        if not isinstance(self.tail, k3_tail.TailConfig):
            raise ValueError(f"tail: expected a k3_tail.TailConfig, got {type(self.tail).__name__}")
        tail = self.tail
        if not tail.has_shared_experts or not tail.use_latent_norm or tail.routed_output_is_reduced:
            raise ValueError("tail: the layer has shared experts, the latent norm and unreduced routed partials; "
                             "expected has_shared_experts=True, use_latent_norm=True, routed_output_is_reduced=False")
        if self.routed_experts is not None and self.routed_experts not in ROUTED_EXPERTS:
            raise ValueError(f"routed_experts: expected None or one of {tuple(ROUTED_EXPERTS)}, "
                             f"got {self.routed_experts!r}")
        if not isinstance(self.early_shared_reduction, bool):
            raise ValueError(f"early_shared_reduction: expected a bool, got {self.early_shared_reduction!r}")
        # The layer decides where its shared output is reduced; its tail is told.
        tail = dataclasses.replace(tail, shared_output_is_reduced=self.early_shared_reduction)
        object.__setattr__(self, "tail", tail)
        for name in ("num_experts", "top_k", "expert_intermediate_size", "shared_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: expected at most num_experts = {self.num_experts}, got {self.top_k}")
        if self.expert_quantization not in EXPERT_QUANTIZATIONS:
            raise ValueError(f"expert_quantization: expected one of {EXPERT_QUANTIZATIONS}, "
                             f"got {self.expert_quantization!r}")
        if self.expert_quantization == "mxfp4":
            if tail.dtype not in mxfp4.DECODED_DTYPES:
                raise ValueError(f"tail: MXFP4 experts decode to {tuple(d.name for d in mxfp4.DECODED_DTYPES)}, "
                                 f"got dtype {tail.dtype.name}")
            for name, width in (("latent_size", tail.latent_size),
                                ("expert_intermediate_size", self.expert_intermediate_size)):
                if width % mxfp4.GROUP_SIZE:
                    raise ValueError(f"{name}: MXFP4 experts need a multiple of {mxfp4.GROUP_SIZE} (one scale per "
                                     f"{mxfp4.GROUP_SIZE} input columns), got {width}")

    @classmethod
    def kimi_k3(cls, *, num_experts: int = 8, top_k: int = 2, width_divisor: int = 1,
                routed_experts: str | None = None, early_shared_reduction: bool = True,
                expert_quantization: str | None = None, **tail_overrides: Any) -> LayerConfig:
        """Kimi-K3's widths (H 7168, L 3584, m 3072, F 6144, bf16, the rest ``k3_tail.TailConfig.kimi_k3``'s), each
        divided by ``width_divisor``, with ``num_experts`` and ``top_k`` (small by default; Kimi-K3 routes to 16 of
        896). ValueError naming ``width_divisor`` unless it divides every width."""
        kimi = k3_tail.TailConfig.kimi_k3()
        widths = (kimi.hidden_size, kimi.latent_size, KIMI_K3_EXPERT_INTERMEDIATE_SIZE,
                  KIMI_K3_SHARED_INTERMEDIATE_SIZE)
        if isinstance(width_divisor, bool) or not isinstance(width_divisor, int) or width_divisor < 1 \
                or any(width % width_divisor for width in widths):
            raise ValueError(f"width_divisor: expected a positive divisor of Kimi-K3's widths {widths}, "
                             f"got {width_divisor!r}")
        hidden, latent, expert, shared = (width // width_divisor for width in widths)
        tail = k3_tail.TailConfig.kimi_k3(**{"hidden_size": hidden, "latent_size": latent, **tail_overrides})
        return cls(tail, num_experts=num_experts, top_k=top_k, expert_intermediate_size=expert,
                   shared_intermediate_size=shared, routed_experts=routed_experts,
                   early_shared_reduction=early_shared_reduction, expert_quantization=expert_quantization)

    @property
    def sizes(self) -> MoELayerSizes:
        """The layer's sizes, as the cost tools take them (:mod:`k3_tail.models.kimi_k3.cost`)."""
        return MoELayerSizes(self.tail, self.num_experts, self.top_k, self.expert_intermediate_size,
                             self.shared_intermediate_size, self.early_shared_reduction)

    @property
    def hidden_size(self) -> int:
        return self.tail.hidden_size

    @property
    def latent_size(self) -> int:
        return self.tail.latent_size

    @property
    def dtype(self) -> np.dtype:
        return self.tail.dtype
