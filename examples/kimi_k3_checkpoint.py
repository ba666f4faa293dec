"""The Kimi-K3 layer of examples/kimi_k3_moe_layer.py from a Hugging Face checkpoint, each rank reading its blocks.

:func:`layer_config_from_hf` makes the layer's :class:`LayerConfig` from the model's config.json;
:func:`load_layer` builds :class:`KimiK3MoELayer` from decoder layer N of the checkpoint, every
parameter made with ``jax.make_array_from_callback`` so that each device reads only the block it
holds (``k3_tail.checkpoint``: safetensors' own reader, any of the layer prefixes it accepts). The
tail's two tensors come from ``k3_tail.load_tail_weights``; the rest, under
``...layers.N.block_sparse_moe.``, map to the layer's parameters (Flax layout, y = x @ W; every torch
Linear weight is [out, in] and read transposed):

    gate.weight                       [E, H]  -> router_kernel [H, E]
    gate.e_score_correction_bias      [E]     -> router_bias [E] (float32)
    routed_expert_down_proj.weight    [L, H]  -> down_proj [H, L]
    experts.e.w1.weight (gate)        [m, L]  -> expert_gate[e] [L, m]   rank i reads rows i*m/p ...
    experts.e.w3.weight (up)          [m, L]  -> expert_up[e] [L, m]     ... of each expert
    experts.e.w2.weight (down)        [L, m]  -> expert_down[e] [m, L]   and those columns of w2
    shared_experts.gate_proj.weight   [F, H]  -> shared_gate [H, F]      F = num_shared_experts * m:
    shared_experts.up_proj.weight     [F, H]  -> shared_up [H, F]        the shared experts are stored
    shared_experts.down_proj.weight   [H, F]  -> shared_down [F, H]      as one MLP already
    routed_expert_norm.weight         [L]     -> norm_scale [L]
    routed_expert_up_proj.weight      [H, L]  -> up_proj_kernel [L, H] (FP8 values and up_proj_scale
                                                 when the tail config asks for FP8)

Kimi-K3 ships its routed experts in MXFP4 (compressed-tensors ``weight_packed`` / ``weight_scale``
tensors, ``quantization_config`` in config.json; the shared experts stay bf16). This layer computes
with bf16 (or float32) experts: :func:`load_layer` then raises a ValueError saying so and naming the
tensors it found, rather than guessing at their encoding. A checkpoint whose experts are stored as
plain ``weight`` tensors (dequantised, or a bf16 model of this architecture) loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

import k3_tail
from examples.kimi_k3_moe_layer import KimiK3MoELayer, LayerConfig, layer_parameters, partition_specs
from examples.kimi_k3_situ import SITU_GATE_BOUND, SITU_UP_BOUND
from k3_tail import hf_config
from k3_tail._checks import check_mesh
from k3_tail.checkpoint import Checkpoint, open_checkpoint, sharded_array
from k3_tail.json_files import read_json

# The model config's activation and routing, as this layer computes them.
HIDDEN_ACT = "situ"
SITU_BETAS = {"activation_situ_beta": SITU_GATE_BOUND, "activation_situ_linear_beta": SITU_UP_BOUND}
# Each routed expert's three weights: (the layer's parameter, the checkpoint's name under experts.e.).
EXPERT_WEIGHTS = (("expert_gate", "w1"), ("expert_up", "w3"), ("expert_down", "w2"))
# The layer's 2-d parameters read as a torch Linear's transpose, by the name under block_sparse_moe.
LINEAR_WEIGHTS = {
    "router_kernel": "gate.weight",
    "down_proj": "routed_expert_down_proj.weight",
    "shared_gate": "shared_experts.gate_proj.weight",
    "shared_up": "shared_experts.up_proj.weight",
    "shared_down": "shared_experts.down_proj.weight",
}
ROUTER_BIAS = "gate.e_score_correction_bias"


def layer_config_from_hf(config: Any, **tail_overrides: Any) -> LayerConfig:
    """The layer's config from a Hugging Face model config (a config.json path, a checkpoint directory or
    a dict; ``text_config`` read when nested): the tail from ``k3_tail.TailConfig.from_hf_config``
    (``tail_overrides`` as its keywords), E = ``num_experts``, k = ``num_experts_per_token``,
    m = ``moe_intermediate_size``, F = ``num_shared_experts`` * m.

    ValueError naming the field when a size is missing or bad, or when the model's activation
    (``hidden_act``, the SiTU betas) or routing (``moe_renormalize`` false) is not what this layer
    computes."""
    text = hf_config.text_config(config)
    act = text.get("hidden_act", HIDDEN_ACT)
    if act != HIDDEN_ACT:
        raise ValueError(f"{text.name('hidden_act')}: this layer computes {HIDDEN_ACT!r}, got {act!r}")
    for name, value in SITU_BETAS.items():
        if text.get(name, value) != value:
            raise ValueError(f"{text.name(name)}: this layer's SiTU uses {value:g}, got {text.get(name)!r}")
    if text.get("moe_renormalize", True) is not True:
        raise ValueError(f"{text.name('moe_renormalize')}: this layer renormalises the top-k weights (for "
                         f"top_k > 1), got {text.get('moe_renormalize')!r}")
    tail = k3_tail.TailConfig.from_hf_config(text, **tail_overrides)
    expert_width = hf_config.field(text, "moe_intermediate_size", minimum=1)
    shared = hf_config.field(text, "num_shared_experts", minimum=1)
    return LayerConfig(tail, num_experts=hf_config.field(text, "num_experts", minimum=1),
                       top_k=hf_config.field(text, "num_experts_per_token", minimum=1),
                       expert_intermediate_size=expert_width, shared_intermediate_size=shared * expert_width)


def load_layer(checkpoint: str | os.PathLike | Checkpoint, layer: int, *, config: LayerConfig, mesh: Mesh,
               axis_name: str = "tp", weight_layout: str = "replicated") -> KimiK3MoELayer:
    """:class:`KimiK3MoELayer` holding decoder layer ``layer`` of ``checkpoint`` (a path or an opened
    ``k3_tail.checkpoint.Checkpoint``), on ``mesh``: :func:`layer_weights` placed as
    ``partition_specs`` says. Arguments and errors as :func:`layer_weights`."""
    weights = layer_weights(checkpoint, layer, config=config, mesh=mesh, axis_name=axis_name,
                            weight_layout=weight_layout)
    return KimiK3MoELayer(config, mesh, weights, axis_name=axis_name, weight_layout=weight_layout)


def layer_weights(checkpoint: str | os.PathLike | Checkpoint, layer: int, *, config: LayerConfig, mesh: Mesh,
                  axis_name: str = "tp", weight_layout: str = "replicated") -> dict[str, jax.Array]:
    """Every parameter of the layer (``layer_parameters``' names) as a global array placed on ``mesh`` as
    ``partition_specs`` says, each device's block read by its own callback (module docstring).

    ValueError naming the layer and the tensor: a dense layer or one past the last, a missing tensor, a
    tensor of another shape or dtype than the config says (the bias may be float32 or the layer's dtype;
    everything else the layer's dtype), routed experts stored quantised (the tensors found are named);
    naming the mesh when it has no axis ``axis_name``.
    """
    tp_size = check_mesh(mesh, axis_name)
    checkpoint = open_checkpoint(checkpoint)
    block = checkpoint.moe_block(layer)
    _refuse_quantized_experts(checkpoint, block, layer)
    specs = partition_specs(config, tp_size, axis_name=axis_name, weight_layout=weight_layout)
    parameters = layer_parameters(config)
    hidden, latent, experts = config.hidden_size, config.latent_size, config.num_experts
    expert_width, shared_width, dtype = config.expert_intermediate_size, config.shared_intermediate_size, config.dtype

    def place(name: str, read_block: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
        return sharded_array(parameters[name].shape, NamedSharding(mesh, specs[name]), read_block,
                             parameters[name].dtype)

    stored_shapes = {"router_kernel": (experts, hidden), "down_proj": (latent, hidden),
                     "shared_gate": (shared_width, hidden), "shared_up": (shared_width, hidden),
                     "shared_down": (hidden, shared_width)}
    weights = {}
    for name, suffix in LINEAR_WEIGHTS.items():
        tensor = block + suffix
        checkpoint.expect(tensor, stored_shapes[name], dtype, layer=layer,
                          what=f"torch's [out, in] of {name} {list(parameters[name].shape)}")
        weights[name] = place(name, lambda index, tensor=tensor: checkpoint.read_transposed(tensor, index))
    bias = block + ROUTER_BIAS
    checkpoint.expect(bias, (experts,), (np.float32, dtype), layer=layer, what="[E]: the router's correction bias",
                      dtype_source="float32 or config.dtype")
    weights["router_bias"] = place("router_bias", lambda index: checkpoint.read(bias, index))
    for name, weight in EXPERT_WEIGHTS:
        tensors = [f"{block}experts.{expert}.{weight}.weight" for expert in range(experts)]
        stored = (latent, expert_width) if weight == "w2" else (expert_width, latent)
        for tensor in tensors:
            checkpoint.expect(tensor, stored, dtype, layer=layer, what=f"torch's [out, in] of one expert's {name}")
        weights[name] = place(name, lambda index, tensors=tensors: np.stack(
            [checkpoint.read_transposed(tensors[expert], index[1:]) for expert in range(*index[0].indices(experts))]))
    norm_weight, kernel = k3_tail.load_tail_weights(checkpoint, layer, config=config.tail, mesh=mesh,
                                                    axis_name=axis_name, weight_layout=weight_layout)
    weights["norm_scale"] = norm_weight
    if isinstance(kernel, k3_tail.QuantizedKernel):
        weights["up_proj_kernel"], weights["up_proj_scale"] = kernel.values, kernel.scale
    else:
        weights["up_proj_kernel"] = kernel
    return weights


def _refuse_quantized_experts(checkpoint: Checkpoint, block: str, layer: int) -> None:
    """ValueError when the routed experts under ``block`` are stored in any form but plain ``weight``
    tensors (Kimi-K3's MXFP4: ``weight_packed``, ``weight_scale``, ...), naming what was found."""
    experts = f"{block}experts."
    quantized = [name for name in checkpoint.names if name.startswith(experts) and not name.endswith(".weight")]
    if not quantized:
        return
    shown = ", ".join(quantized[:4]) + (f" and {len(quantized) - 4} more" if len(quantized) > 4 else "")
    raise ValueError(f"layer {layer}: the routed experts are stored quantised ({shown}{_quantization(checkpoint)}); "
                     "this layer computes with bf16 or float32 experts and does not dequantise them: load a "
                     "checkpoint whose experts are plain .weight tensors")


def _quantization(checkpoint: Checkpoint) -> str:
    """"; config.json: quantization_config <method>, <format>" when the checkpoint's directory has a
    config.json that says how it quantises, else ""."""
    directory = checkpoint.path if checkpoint.path.is_dir() else checkpoint.path.parent
    try:
        whole = read_json(Path(directory, hf_config.CONFIG_FILE), what="config")
    except ValueError:
        return ""
    text = whole.get(hf_config.TEXT_CONFIG, {}) if isinstance(whole, dict) else {}
    quantization = (whole.get("quantization_config") if isinstance(whole, dict) else None) or (
        text.get("quantization_config") if isinstance(text, dict) else None)
    if not isinstance(quantization, dict):
        return ""
    groups = quantization.get("config_groups")
    formats = [group.get("format") for group in groups.values() if isinstance(group, dict)] if isinstance(
        groups, dict) else []
    described = ", ".join(str(part) for part in (quantization.get("quant_method"), quantization.get("format"),
                                                 *formats) if part)
    return f"; config.json: quantization_config {described or 'present'}"
