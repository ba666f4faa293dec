"""The Kimi-K3 latent MoE layer under tensor parallelism, ending in k3_tail's tail (:mod:`.layer`), its loading
from a Hugging Face checkpoint (:mod:`.checkpoint`), its float64 reference (:mod:`.reference`) and a decoder stack
of it (:mod:`.stack`). docs/kimi_k3.md is the guide.
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
