"""The Kimi-K3 layer of k3_tail/models/kimi_k3/layer.py from a Hugging Face checkpoint, each rank reading its blocks.

The tensors under ``...layers.N.block_sparse_moe.`` map to the layer's parameters (Flax layout, y = x @ W: every
torch Linear weight [out, in] is read transposed); the tail's two come from ``k3_tail.load_tail_weights``:

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

MXFP4 experts (compressed-tensors' ``weight_packed`` and ``weight_scale``, transposed alike, rank i reading its
slice's bytes) load as stored with ``LayerConfig(expert_quantization="mxfp4")``; docs/kimi_k3.md, "MXFP4 routed
experts", has their layout.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

import k3_tail
from k3_tail import hf_config
from k3_tail._checks import check_mesh
from k3_tail.checkpoint import Checkpoint, open_checkpoint
from k3_tail.json_files import read_json
from k3_tail.models.kimi_k3 import mxfp4
from k3_tail.models.kimi_k3.layer import KimiK3MoELayer
from k3_tail.models.kimi_k3.layer_config import LayerConfig
from k3_tail.models.kimi_k3.parameters import ROUTED_EXPERT_SCALES, layer_parameters, partition_specs
from k3_tail.models.kimi_k3.situ import SITU_GATE_BOUND, SITU_UP_BOUND

# The model config's activation and routing, as this layer computes them.
HIDDEN_ACT = "situ"
SITU_BETAS = {"activation_situ_beta": SITU_GATE_BOUND, "activation_situ_linear_beta": SITU_UP_BOUND}
# Each routed expert's three weights: (the layer's parameter, the checkpoint's name under experts.e.).
EXPERT_WEIGHTS = (("expert_gate", "w1"), ("expert_up", "w3"), ("expert_down", "w2"))
# What each of them is stored as, after "experts.e.wN.": in the layer's dtype, or as compressed-tensors' MXFP4.
EXPERT_TENSORS = {None: ("weight",), "mxfp4": (mxfp4.PACKED, mxfp4.SCALE)}
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
    """The layer's config from a Hugging Face model config (a config.json path, a checkpoint directory or a dict):
    the tail from ``k3_tail.TailConfig.from_hf_config`` (``tail_overrides`` as its keywords), E = ``num_experts``,
    k = ``num_experts_per_token``, m = ``moe_intermediate_size``, F = ``num_shared_experts`` * m and
    :func:`expert_quantization_from_hf`. ValueError naming the field for a missing or bad size, an activation or
    routing this layer does not compute, or a ``quantization_config`` other than MXFP4 weights."""
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
                       expert_intermediate_size=expert_width, shared_intermediate_size=shared * expert_width,
                       expert_quantization=expert_quantization_from_hf(text))


def expert_quantization_from_hf(text: Any) -> str | None:
    """"mxfp4" when the text config's ``quantization_config`` (or its wrapper's) is compressed-tensors'
    ``mxfp4-pack-quantized`` with unquantised activations, None when there is none; ValueError naming the field
    for any other."""
    text = hf_config.text_config(text)
    quantization, where = text.inherited("quantization_config")
    if quantization is None:
        return None
    groups = quantization.get("config_groups", {}) if isinstance(quantization, Mapping) else None
    objects = isinstance(groups, Mapping) and all(
        isinstance(group, Mapping) and isinstance(group.get("weights") or {}, Mapping) for group in groups.values())
    if not objects:
        raise ValueError(f"{where}: expected a JSON object whose config_groups (and their weights) are JSON objects, "
                         f"got {quantization!r}")
    # Each field that says how the weights are stored: (its value, MXFP4's).
    fields = {f"{where}.quant_method": (quantization.get("quant_method"), mxfp4.QUANT_METHOD),
              f"{where}.format": (quantization.get("format"), mxfp4.FORMAT)}
    for key, group in groups.items():
        at, weights = f"{where}.config_groups.{key}", group.get("weights") or {}
        fields.update({f"{at}.format": (group.get("format", mxfp4.FORMAT), mxfp4.FORMAT),
                       f"{at}.weights.num_bits": (weights.get("num_bits", mxfp4.CODE_BITS), mxfp4.CODE_BITS),
                       f"{at}.weights.type": (weights.get("type", "float"), "float"),
                       f"{at}.weights.group_size": (weights.get("group_size", mxfp4.GROUP_SIZE), mxfp4.GROUP_SIZE),
                       f"{at}.input_activations": (group.get("input_activations"), None)})
    for field, (value, expected) in fields.items():
        if value != expected:
            raise ValueError(f"{field}: this layer loads compressed-tensors' {mxfp4.FORMAT!r} experts (4-bit float "
                             f"weights in groups of {mxfp4.GROUP_SIZE}, activations unquantised): expected "
                             f"{expected!r}, got {value!r}")
    return "mxfp4"


def load_layer(checkpoint: str | os.PathLike | Checkpoint, layer: int, *, config: LayerConfig, mesh: Mesh,
               axis_name: str = "tp", weight_layout: str = "replicated") -> KimiK3MoELayer:
    """:class:`KimiK3MoELayer` holding decoder layer ``layer`` of ``checkpoint`` (a path or an opened
    ``k3_tail.checkpoint.Checkpoint``) on ``mesh``; arguments and errors as :func:`layer_weights`."""
    weights = layer_weights(checkpoint, layer, config=config, mesh=mesh, axis_name=axis_name,
                            weight_layout=weight_layout)
    return KimiK3MoELayer(config, mesh, weights, axis_name=axis_name, weight_layout=weight_layout)


def layer_weights(checkpoint: str | os.PathLike | Checkpoint, layer: int, *, config: LayerConfig, mesh: Mesh,
                  axis_name: str = "tp", weight_layout: str = "replicated") -> dict[str, jax.Array]:
    """Every parameter of the layer (``layer_parameters``' names) as a global array placed on ``mesh`` as
    ``partition_specs`` says, each device's block read by its own callback (module docstring).

    ValueError naming the layer and the tensor: a dense layer or one past the last, a missing tensor, another
    shape or dtype (the bias float32 or the layer's dtype, MXFP4 uint8, the rest the layer's dtype), experts
    stored otherwise than ``config.expert_quantization`` says, MXFP4 slices that split a group of 32 columns, or
    MXFP4 groups past the dtype's range; naming the mesh when it has no axis ``axis_name``.
    """
    tp_size = check_mesh(mesh, axis_name)
    checkpoint = open_checkpoint(checkpoint)
    block = checkpoint.moe_block(layer)
    _check_expert_storage(checkpoint, block, layer, config)
    if config.expert_quantization == "mxfp4":
        _check_group_aligned_slices(block, layer, config, tp_size)
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

    def read_experts(tensors: list[str], index: tuple[slice, ...]) -> np.ndarray:
        """Block ``index`` [experts, rows, columns] of the experts' stacked Flax-layout kernels."""
        return np.stack([checkpoint.read_transposed(tensors[expert], index[1:])
                         for expert in range(*index[0].indices(experts))])

    for name, weight in EXPERT_WEIGHTS:
        stored = (latent, expert_width) if weight == "w2" else (expert_width, latent)
        what = f"torch's [out, in] of one expert's {name}"
        tensors = {suffix: [f"{block}experts.{expert}.{weight}.{suffix}" for expert in range(experts)]
                   for suffix in EXPERT_TENSORS[config.expert_quantization]}
        if config.expert_quantization is None:
            for tensor in tensors["weight"]:
                checkpoint.expect(tensor, stored, dtype, layer=layer, what=what)
            weights[name] = place(name, functools.partial(read_experts, tensors["weight"]))
            continue
        for suffix, (shape, holds) in mxfp4.stored_tensors(*stored).items():
            for tensor in tensors[suffix]:
                checkpoint.expect(tensor, shape, mxfp4.STORED_DTYPE, layer=layer, what=f"{what}: {holds}",
                                  dtype_source=mxfp4.FORMAT)
        packed, scales = tensors[mxfp4.PACKED], tensors[mxfp4.SCALE]
        weights[name] = place(name, functools.partial(read_experts, packed))
        weights[ROUTED_EXPERT_SCALES[name]] = place(ROUTED_EXPERT_SCALES[name], functools.partial(
            _read_checked_scales, functools.partial(read_experts, packed), functools.partial(read_experts, scales),
            scales, layer=layer, dtype=dtype))
    norm_weight, kernel = k3_tail.load_tail_weights(checkpoint, layer, config=config.tail, mesh=mesh,
                                                    axis_name=axis_name, weight_layout=weight_layout)
    weights["norm_scale"] = norm_weight
    if isinstance(kernel, k3_tail.QuantizedKernel):
        weights["up_proj_kernel"], weights["up_proj_scale"] = kernel.values, kernel.scale
    else:
        weights["up_proj_kernel"] = kernel
    return weights


def sharded_array(shape: Sequence[int], sharding: NamedSharding, read_block: Callable[[tuple[slice, ...]], np.ndarray],
                  dtype: Any) -> jax.Array:
    """The global array of ``shape`` and ``dtype`` in ``sharding``, each device's block ``read_block(index)``
    (one resolved slice of step 1 per axis), cast to ``dtype``."""
    shape = tuple(shape)
    dtype = np.dtype(dtype)

    def block(index):
        resolved = tuple(slice(*axis.indices(size)[:2]) for axis, size in zip(index, shape, strict=True))
        value = read_block(resolved)
        return value if value.dtype == dtype else value.astype(dtype)

    return jax.make_array_from_callback(shape, sharding, block, dtype=dtype)


def _check_expert_storage(checkpoint: Checkpoint, block: str, layer: int, config: LayerConfig) -> None:
    """ValueError, naming what was found and the setting that loads it, when the routed experts under ``block``
    hold tensors other than :data:`EXPERT_TENSORS` of ``config.expert_quantization``."""
    experts = f"{block}experts."
    wanted = EXPERT_TENSORS[config.expert_quantization]
    other = [name for name in checkpoint.names if name.startswith(experts) and name.rsplit(".", 1)[-1] not in wanted]
    if not other:
        return
    shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
    if config.expert_quantization is None:
        raise ValueError(f"layer {layer}: the routed experts are stored quantised ({shown}"
                         f"{_quantization(checkpoint)}); this LayerConfig holds them in {config.dtype.name} "
                         f"(expert_quantization=None): compressed-tensors' {mxfp4.FORMAT} experts (weight_packed, "
                         "weight_scale) load with LayerConfig(expert_quantization='mxfp4'), which "
                         "layer_config_from_hf sets from the model's quantization_config")
    raise ValueError(f"layer {layer}: the routed experts hold tensors that are not {mxfp4.FORMAT}'s weight_packed "
                     f"and weight_scale ({shown}); LayerConfig(expert_quantization='mxfp4') loads those only, and "
                     "experts stored as plain .weight tensors load with expert_quantization=None")


def _check_group_aligned_slices(block: str, layer: int, config: LayerConfig, tp_size: int) -> None:
    """ValueError naming w2's scale tensor, rank 1's slice and the group size unless each rank's m / p input
    columns of w2 are whole MXFP4 groups of 32."""
    width = config.expert_intermediate_size
    if width % tp_size or (width // tp_size) % mxfp4.GROUP_SIZE == 0:
        return  # p not dividing m: partition_specs names that
    share = width // tp_size
    raise ValueError(f"layer {layer}: {block}experts.0.w2.weight_scale (and every expert's w2): with p = {tp_size} "
                     f"each rank holds {share} of w2's {width} input columns (rank 1: columns [{share}, {2 * share})), "
                     f"not whole MXFP4 groups of {mxfp4.GROUP_SIZE} columns under one scale byte (nor always whole "
                     f"bytes of {mxfp4.CODES_PER_BYTE} codes): MXFP4 experts need m / p a multiple of "
                     f"{mxfp4.GROUP_SIZE}, a p dividing {width // mxfp4.GROUP_SIZE}")


def _read_checked_scales(read_packed: Callable, read_scales: Callable, scale_tensors: list[str],
                         index: tuple[slice, ...], *, layer: int, dtype: np.dtype) -> np.ndarray:
    """Block ``index`` [experts, groups, columns] of the stacked scales; ValueError naming the tensor, the row and
    the input columns when a group decodes past ``dtype``'s range (its codes read only under scales 2^126, 2^127)."""
    scales = read_scales(index)
    if not np.isin(scales, mxfp4.OVERFLOWING_SCALES).any():
        return scales
    experts, groups, columns = index
    per_group = mxfp4.GROUP_SIZE // mxfp4.CODES_PER_BYTE
    packed = read_packed((experts, slice(groups.start * per_group, groups.stop * per_group), columns))
    bad = np.argwhere(mxfp4.overflowing_groups(packed, scales))
    if not len(bad):
        return scales
    expert, group, row = (int(value) for value in bad[0])
    group, row = group + groups.start, row + columns.start
    scale = int(scales[tuple(bad[0])])
    raise ValueError(f"layer {layer}: {scale_tensors[expert + experts.start]}: row {row}, input columns "
                     f"[{group * mxfp4.GROUP_SIZE}, {(group + 1) * mxfp4.GROUP_SIZE}): the scale 2^{scale - 127} "
                     f"makes values past {dtype.name}'s largest finite ({float(jnp.finfo(dtype).max):.4g}); "
                     f"{len(bad)} such group(s) in this block")


def _quantization(checkpoint: Checkpoint) -> str:
    """"; config.json: quantization_config <method>, <format>" from the checkpoint's config.json, or ""."""
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
