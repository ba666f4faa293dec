"""k3_tail: the Kimi-K3 latent MoE tail under tensor parallelism, in JAX.

    y = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i      (replicated on every TP rank)

Five tiers compute it (native, overlap, column-parallel, scatter-gather, one-shot); ``select_tier``
picks one per token count (vLLM's rule, a measured table or the cost model) and says why;
``tail_forward`` runs it on global arrays; ``LatentMoETail`` is the Flax NNX module. Tier functions
run inside ``jax.shard_map`` over a named TP axis.
``compile_tail`` compiles one call (also for a deviceless GPU topology, ``topology_mesh``) and
``k3_tail.xla_report`` reads what XLA made of it. ``k3_tail.cost_model`` predicts each tier's cost,
``k3_tail.benchmark`` measures it, ``k3_tail.calibration`` turns measurements into a selection table.
"""

from k3_tail import benchmark, calibration, cost_model, multiprocess, xla_report
from k3_tail.calibration import SelectionTable, TokenRange
from k3_tail.column_parallel import column_parallel_tail
from k3_tail.columns import WEIGHT_LAYOUTS, padded_hidden_size
from k3_tail.compilation import compile_tail, compiler_options, tail_arguments
from k3_tail.config import TailConfig
from k3_tail.forward import tail_forward
from k3_tail.module import LatentMoETail
from k3_tail.native import native_tail
from k3_tail.one_shot import one_shot_tail
from k3_tail.norm import allreduce_norm_latent_out, rms_norm
from k3_tail.overlap import overlap_tail
from k3_tail.scatter_gather import scatter_gather_tail
from k3_tail.selection import Tier, TierDecision, select_tier
from k3_tail.topologies import GPU_TARGETS, TopologyUnavailable, topology_mesh
from k3_tail.xla_report import XlaReport

__all__ = [
    "GPU_TARGETS",
    "LatentMoETail",
    "SelectionTable",
    "TailConfig",
    "Tier",
    "TierDecision",
    "TokenRange",
    "TopologyUnavailable",
    "WEIGHT_LAYOUTS",
    "XlaReport",
    "allreduce_norm_latent_out",
    "benchmark",
    "calibration",
    "column_parallel_tail",
    "multiprocess",
    "compile_tail",
    "compiler_options",
    "cost_model",
    "native_tail",
    "one_shot_tail",
    "overlap_tail",
    "padded_hidden_size",
    "rms_norm",
    "scatter_gather_tail",
    "select_tier",
    "tail_arguments",
    "tail_forward",
    "topology_mesh",
    "xla_report",
]
