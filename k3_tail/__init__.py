"""k3_tail: the Kimi-K3 latent MoE tail under tensor parallelism, in JAX.

    y = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i      (replicated on every TP rank)

The tiers (:class:`Tier`) compute it with different schedules; :func:`select_tier` picks one per call and says
why. Entry points: :func:`latent_moe_tail` per rank inside a model's ``jax.shard_map``, :func:`tail_forward` on
global arrays, :class:`LatentMoETail` (Flax NNX), and :func:`reduce_shared`, the shared experts' sum issued early.
The Kimi-K3 model, :mod:`k3_tail.models.kimi_k3`, is not loaded by ``import k3_tail``. The map: docs/design.md.
"""

from k3_tail.checkpoint import load_tail_weights
from k3_tail.config import TailConfig
from k3_tail.deviceless.topologies import TopologyUnavailable, topology_mesh
from k3_tail.forward import tail_forward
from k3_tail.module import LatentMoETail
from k3_tail.ops.columns import padded_hidden_size
from k3_tail.ops.tokens import padded_token_count
from k3_tail.ops.up_projection import QuantizedKernel, quantize_up_proj
from k3_tail.per_rank import latent_moe_tail
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.rules import select_tier
from k3_tail.selection.table import SelectionTable
from k3_tail.shared_reduction import reduce_shared
from k3_tail.tiers.context import is_token_sharded_output
from k3_tail.tiers.registry import Tier
from k3_tail.xla.compilation import compile_tail
from k3_tail.xla.report import XlaReport

__all__ = [
    "LatentMoETail",
    "QuantizedKernel",
    "SelectionTable",
    "TailConfig",
    "Tier",
    "TierDecision",
    "TopologyUnavailable",
    "XlaReport",
    "compile_tail",
    "is_token_sharded_output",
    "latent_moe_tail",
    "load_tail_weights",
    "padded_hidden_size",
    "padded_token_count",
    "quantize_up_proj",
    "reduce_shared",
    "select_tier",
    "tail_forward",
    "topology_mesh",
]
