"""The tail's own tensors of a Hugging Face checkpoint's MoE layer, each device reading only its block:
``block_sparse_moe.routed_expert_up_proj.weight`` [H, L] (torch's [out, in]: the kernel [L, H] transposed) and
``block_sparse_moe.routed_expert_norm.weight`` [L] (the RMSNorm scale, with latent_moe_use_norm).

Column k of the kernel is row k of the stored tensor, so each device reads one contiguous run of rows and the
whole kernel is never in one place; an FP8 kernel is quantised block by block (a column's scale needs only it).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail._checks import AxisName, check_axis_name, check_mesh
from k3_tail.checkpoint.naming import Checkpoint, open_checkpoint
from k3_tail.config import TailConfig, check_config
from k3_tail.ops.columns import check_weight_layout, padded_hidden_size
from k3_tail.ops.up_projection import QuantizedKernel, quantize_up_proj

UP_PROJ, NORM = "routed_expert_up_proj.weight", "routed_expert_norm.weight"


def load_tail_weights(
    checkpoint: str | os.PathLike | Checkpoint,
    layer: int,
    *,
    config: TailConfig,
    mesh: Mesh,
    axis_name: AxisName = "tp",
    weight_layout: str = "column",
) -> tuple[jax.Array | None, jax.Array | QuantizedKernel]:
    """The tail's weights of decoder layer ``layer`` of ``checkpoint``, placed on ``mesh``, each device reading
    only its block of the kernel.

    Args:
      checkpoint: a checkpoint path or an opened :class:`Checkpoint` (many layers from one parse of its index).
      layer: the decoder layer, a MoE one.
      config: the tail's :class:`k3_tail.TailConfig` (e.g. ``TailConfig.from_hf_config(directory)``).
      mesh: the Mesh to place the weights on.
      axis_name: the TP axis.
      weight_layout: "column": the kernel stored [L, padded_hidden_size(H, p)] with zero padding
        columns, sharded ``P(None, axis_name)``. "replicated": [L, H] on every device (``P()``).

    Returns:
      ``(norm_weight, up_proj_kernel)``: norm_weight [L] of ``config.dtype``, replicated, or None when
      ``config.use_latent_norm`` is False; up_proj_kernel the transpose [L, H] of the stored [H, L] weight in
      the layout's shape, or with an FP8 ``config.up_proj_dtype`` a :class:`k3_tail.QuantizedKernel` as
      :func:`k3_tail.quantize_up_proj` makes it (padding columns' values and scales zero).

    Raises:
      ValueError: naming the layer and the tensor, for a dense layer, a layer past the last, a missing tensor,
        another shape or dtype, a norm weight without ``use_latent_norm``, or non-finite values to quantise;
        naming the argument for a bad config, mesh, axis or layout.
    """
    check_config(config)
    axis_name = check_axis_name(axis_name)
    tp_size = check_mesh(mesh, axis_name)
    weight_layout = check_weight_layout(weight_layout)
    checkpoint = open_checkpoint(checkpoint)
    block = checkpoint.moe_block(layer)
    hidden, latent, dtype = config.hidden_size, config.latent_size, config.dtype
    up_name, norm_name = block + UP_PROJ, block + NORM
    checkpoint.expect(up_name, (hidden, latent), dtype, layer=layer,
                      what=f"[H, L] = [{hidden}, {latent}]: torch's [out, in] of the up projection")
    norm_weight = None
    if config.use_latent_norm:
        checkpoint.expect(norm_name, (latent,), dtype, layer=layer, what=f"[L] = [{latent}]: the latent RMSNorm scale")
        norm_weight = jax.make_array_from_callback((latent,), NamedSharding(mesh, P()),
                                                   lambda index: checkpoint.read(norm_name, index))
    elif norm_name in checkpoint:
        raise ValueError(f"layer {layer}: {norm_name}: the checkpoint has the latent norm's scale but "
                         "config.use_latent_norm is False (latent_moe_use_norm in the model's config)")
    kernel = _up_projection(checkpoint, up_name, layer=layer, config=config, mesh=mesh,
                            columns=axis_name if weight_layout == "column" else None, tp_size=tp_size)
    return norm_weight, kernel


def _up_projection(checkpoint: Checkpoint, name: str, *, layer: int, config: TailConfig, mesh: Mesh,
                   columns: AxisName | None, tp_size: int) -> jax.Array | QuantizedKernel:
    """The kernel [L, width] from the stored [H, L] weight, each device's block read (and quantised) by its own
    callback; split over ``columns``, or replicated when that is None."""
    hidden, latent = config.hidden_size, config.latent_size
    width = hidden if columns is None else padded_hidden_size(hidden, tp_size)
    values_sharding = NamedSharding(mesh, P() if columns is None else P(None, columns))
    fp8 = config.up_proj_dtype
    scales: dict[tuple[int, int], np.ndarray] = {}

    def real_columns(start: int, stop: int) -> np.ndarray:
        """Columns [start, stop) of the kernel that are not padding: [L, n]."""
        stop = min(stop, hidden)
        if stop <= start:
            return np.zeros((latent, 0), config.dtype)
        return checkpoint.read_transposed(name, (slice(None), slice(start, stop)))

    def values_block(index) -> np.ndarray:
        start, stop, _ = index[1].indices(width)
        real = real_columns(start, stop)
        values = np.zeros((latent, stop - start), config.dtype if fp8 is None else fp8)
        if fp8 is None:
            values[:, :real.shape[1]] = real
            return values
        scale = np.zeros(stop - start, np.float32)
        if real.shape[1]:
            try:
                quantized = quantize_up_proj(real, fp8)
            except ValueError as error:
                raise ValueError(f"layer {layer}: {name}: {error}") from None
            values[:, :real.shape[1]] = np.asarray(quantized.values)
            scale[:real.shape[1]] = np.asarray(quantized.scale)
        scales[(start, stop)] = scale
        return values

    values = jax.make_array_from_callback((latent, width), values_sharding, values_block)
    if fp8 is None:
        return values

    def scale_block(index) -> np.ndarray:
        start, stop, _ = index[0].indices(width)
        if (start, stop) not in scales:  # every values block was read above; only a differing split lands here
            values_block((slice(None), slice(start, stop)))
        return scales[(start, stop)]

    scale_sharding = NamedSharding(mesh, P() if columns is None else P(columns))
    return QuantizedKernel(values, jax.make_array_from_callback((width,), scale_sharding, scale_block))
