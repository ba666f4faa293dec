"""k3_tail: the Kimi-K3 latent MoE tail under tensor parallelism, in JAX.

    y = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i      (replicated on every TP rank)

The tiers (``Tier``; one module and one record each under ``k3_tail.tiers``) all compute it with
different schedules; ``select_tier`` picks one per token count (vLLM's rule, a measured table or the
cost model) and says why. ``latent_moe_tail`` is the per-rank entry point, for a model's own
``jax.shard_map``, and ``reduce_shared`` the shared experts' reduction issued before the routed
experts (for ``TailConfig(shared_output_is_reduced=True)``); ``tail_forward`` runs the tail on global
arrays; ``LatentMoETail`` is the Flax NNX module. ``load_tail_weights`` reads a layer's norm weight
and up projection from a Hugging Face checkpoint, each device its own block (``k3_tail.checkpoint``;
``TailConfig.from_hf_config`` reads the tail's settings from the model's config.json,
``k3_tail.hf_config``). ``quantize_up_proj`` stores the up projection in FP8
(``QuantizedKernel``, for ``TailConfig(up_proj_dtype=...)``). ``compile_tail`` compiles one call
(also for a deviceless GPU topology, ``topology_mesh``) and ``k3_tail.xla_report`` reads what XLA
made of it; ``k3_tail.cost_model`` predicts each tier's cost. The benchmark (``k3_tail.benchmark``)
and the multi-process helper (``k3_tail.multiprocess``) load on first use: ``import k3_tail`` loads
only the core.
"""

import importlib

from k3_tail import checkpoint, hf_config
from k3_tail.checkpoint import load_tail_weights
from k3_tail.config import TailConfig
from k3_tail.forward import tail_forward
from k3_tail.module import LatentMoETail
from k3_tail.per_rank import latent_moe_tail
from k3_tail.selection import cost_model
from k3_tail.selection import table as calibration
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.rules import select_tier
from k3_tail.selection.table import SelectionTable, TokenRange
from k3_tail.shared_reduction import reduce_shared
from k3_tail.tiers.column_parallel import column_parallel_tail
from k3_tail.ops.columns import WEIGHT_LAYOUTS, padded_hidden_size
from k3_tail.tiers.native import native_tail
from k3_tail.ops.norm import allreduce_norm_latent_out, rms_norm
from k3_tail.tiers.one_shot import one_shot_tail
from k3_tail.tiers.overlap import overlap_tail
from k3_tail.tiers.record import TierRecord
from k3_tail.tiers.registry import Tier
from k3_tail.tiers.scatter_gather import scatter_gather_tail
from k3_tail.tiers.token_parallel import token_parallel_tail
from k3_tail.ops.tokens import is_token_sharded_output, padded_token_count
from k3_tail.ops.up_projection import FP8_FORMATS, QuantizedKernel, quantize_up_proj
from k3_tail.xla import report as xla_report
from k3_tail.xla.compilation import compile_tail, compiler_options, tail_arguments
from k3_tail.xla.report import XlaReport
from k3_tail.xla.topologies import GPU_TARGETS, TopologyUnavailable, topology_mesh

# Tools that are not part of the core, imported when first used as attributes of the package.
_TOOLS = {"benchmark": "k3_tail.tools.benchmark", "multiprocess": "k3_tail.tools.multiprocess"}

__all__ = [
    "FP8_FORMATS",
    "GPU_TARGETS",
    "LatentMoETail",
    "QuantizedKernel",
    "SelectionTable",
    "TailConfig",
    "Tier",
    "TierDecision",
    "TierRecord",
    "TokenRange",
    "TopologyUnavailable",
    "WEIGHT_LAYOUTS",
    "XlaReport",
    "allreduce_norm_latent_out",
    "benchmark",
    "calibration",
    "checkpoint",
    "column_parallel_tail",
    "compile_tail",
    "compiler_options",
    "cost_model",
    "hf_config",
    "is_token_sharded_output",
    "latent_moe_tail",
    "load_tail_weights",
    "multiprocess",
    "native_tail",
    "one_shot_tail",
    "overlap_tail",
    "padded_hidden_size",
    "padded_token_count",
    "quantize_up_proj",
    "reduce_shared",
    "rms_norm",
    "scatter_gather_tail",
    "select_tier",
    "tail_arguments",
    "tail_forward",
    "token_parallel_tail",
    "topology_mesh",
    "xla_report",
]


def __getattr__(name: str):
    if name in _TOOLS:
        return importlib.import_module(_TOOLS[name])
    raise AttributeError(f"module 'k3_tail' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TOOLS))
