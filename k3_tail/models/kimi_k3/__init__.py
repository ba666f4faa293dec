"""The Kimi-K3 latent MoE layer under tensor parallelism, ending in k3_tail's tail, and a decoder stack of it.

- :mod:`~k3_tail.models.kimi_k3.layer`: :class:`LayerConfig`, the parameters and their partition specs,
  :func:`layer_forward` (one ``jax.shard_map``), :class:`KimiK3MoELayer` (Flax NNX), :func:`compile_layer`.
- :mod:`~k3_tail.models.kimi_k3.routed_experts`: the routed experts' methods (gather, capacity, ragged_dot).
- :mod:`~k3_tail.models.kimi_k3.checkpoint`: the config and a layer from a Hugging Face checkpoint.
- :mod:`~k3_tail.models.kimi_k3.reference`: the float64 numpy reference.
- :mod:`~k3_tail.models.kimi_k3.cost`, :mod:`~k3_tail.models.kimi_k3.schedule`: predicted cost, compiled schedule.
- :mod:`~k3_tail.models.kimi_k3.mxfp4`, :mod:`~k3_tail.models.kimi_k3.mxfp4_experts`,
  :mod:`~k3_tail.models.kimi_k3.mxfp4_matmul`: the released checkpoint's MXFP4 experts, their format and kernel.
"""

from k3_tail.models.kimi_k3.checkpoint import layer_config_from_hf, load_layer
from k3_tail.models.kimi_k3.layer import (
    KIMI_K3_NUM_EXPERTS,
    KIMI_K3_TOP_K,
    KimiK3MoELayer,
    LayerConfig,
    abstract_parameters,
    build_layer,
    compile_layer,
    layer_forward,
    layer_parameters,
    partition_specs,
    random_checkpoint,
)
from k3_tail.models.kimi_k3.reference import reference_layer

__all__ = [
    "KIMI_K3_NUM_EXPERTS", "KIMI_K3_TOP_K", "KimiK3MoELayer", "LayerConfig", "abstract_parameters", "build_layer",
    "compile_layer", "layer_config_from_hf", "layer_forward", "layer_parameters", "load_layer", "partition_specs",
    "random_checkpoint", "reference_layer",
]
