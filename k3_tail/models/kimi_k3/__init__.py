"""The Kimi-K3 latent MoE layer under tensor parallelism, ending in k3_tail's tail, and a decoder stack of it.

- :mod:`~k3_tail.models.kimi_k3.layer`: :func:`layer_forward` (one ``jax.shard_map``), :class:`KimiK3MoELayer`
  (Flax NNX), :func:`compile_layer`; its shapes :class:`LayerConfig` (:mod:`~k3_tail.models.kimi_k3.layer_config`),
  its parameters and their partition specs (:mod:`~k3_tail.models.kimi_k3.parameters`), what it holds per rank
  (:mod:`~k3_tail.models.kimi_k3.packed_parameters`) and its work on one rank (:mod:`~k3_tail.models.kimi_k3.per_rank`).
- :mod:`~k3_tail.models.kimi_k3.routed_experts`: the routed experts' methods (gather, capacity, ragged_dot).
- :mod:`~k3_tail.models.kimi_k3.checkpoint`: the config and a layer from a Hugging Face checkpoint.
- :mod:`~k3_tail.models.kimi_k3.reference`: the float64 numpy reference.
- :mod:`~k3_tail.models.kimi_k3.cost`, :mod:`~k3_tail.models.kimi_k3.schedule`: predicted cost, compiled schedule.
- :mod:`~k3_tail.models.kimi_k3.mxfp4`, :mod:`~k3_tail.models.kimi_k3.mxfp4_experts`,
  :mod:`~k3_tail.models.kimi_k3.mxfp4_matmul`: the released checkpoint's MXFP4 experts, their format and kernel.
- :mod:`~k3_tail.models.kimi_k3.stack`: :class:`StackConfig`, N layers after their pre-norms as one scan
  (:func:`stack_forward`, :class:`DecoderStack`, :func:`load_stack`, :func:`compile_stack`).
"""

from k3_tail.models.kimi_k3.checkpoint import layer_config_from_hf, load_layer
from k3_tail.models.kimi_k3.layer import KimiK3MoELayer, build_layer, compile_layer, layer_forward
from k3_tail.models.kimi_k3.layer_config import KIMI_K3_NUM_EXPERTS, KIMI_K3_TOP_K, LayerConfig
from k3_tail.models.kimi_k3.packed_parameters import abstract_parameters, pack_parameters
from k3_tail.models.kimi_k3.parameters import layer_parameters, partition_specs, random_checkpoint
from k3_tail.models.kimi_k3.reference import reference_layer
from k3_tail.models.kimi_k3.saved_layer import restore_layer

__all__ = [
    "KIMI_K3_NUM_EXPERTS", "KIMI_K3_TOP_K", "KimiK3MoELayer", "LayerConfig", "abstract_parameters", "build_layer",
    "compile_layer", "layer_config_from_hf", "layer_forward", "layer_parameters", "load_layer", "pack_parameters",
    "partition_specs",
    "random_checkpoint", "reference_layer", "restore_layer",
    "DecoderStack", "StackConfig", "build_stack", "compile_stack", "load_stack", "reference_stack", "stack_forward",
]

STACK_NAMES = ("DecoderStack", "StackConfig", "build_stack", "compile_stack", "load_stack", "reference_stack",
               "stack_forward")


def __getattr__(name):
    # The stack's names load on first use, so that `python -m k3_tail.models.kimi_k3.stack` runs a module that the
    # package has not imported already (runpy warns otherwise).
    if name in STACK_NAMES:
        from k3_tail.models.kimi_k3 import stack

        return getattr(stack, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
