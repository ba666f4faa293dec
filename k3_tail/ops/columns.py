"""Column blocks of the up projection: weight layouts, padding, and each rank's own block.

Rank k owns the columns [k*Hb, (k+1)*Hb), Hb = ceil(H / p), zero-padded to p*Hb and sliced back to H (vLLM's
CUDA tier 2 drops the last H mod p). Layouts: "replicated" (the whole kernel) and "column" (``P(None, axis)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName, check_int
from k3_tail.ops.scopes import OUTPUT_GATHER
from k3_tail.ops.up_projection import QuantizedKernel, map_columns, project

Kernel = jax.Array | QuantizedKernel

WEIGHT_LAYOUTS = ("column", "replicated")


def check_weight_layout(weight_layout: str) -> str:
    """``weight_layout`` unchanged, or ValueError when it is not one of WEIGHT_LAYOUTS."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout: expected one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    return weight_layout


def padded_hidden_size(hidden_size: int, tp_size: int) -> int:
    """H = ``hidden_size`` rounded up to a multiple of p = ``tp_size``: a column-layout kernel is stored
    [L, padded_hidden_size(H, p)], the extra columns zero.

    Raises:
      ValueError: naming the argument, unless both are integers >= 1.
    """
    hidden_size = check_int("hidden_size", hidden_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    return column_block_width(hidden_size, tp_size) * tp_size


def column_block_width(hidden_size: int, tp_size: int) -> int:
    """Hb = ceil(H / p), the columns a rank owns, for integers H, p >= 1 (checked by :func:`padded_hidden_size`)."""
    return -(-hidden_size // tp_size)


def pad_columns(x: Kernel, width: int) -> Kernel:
    """``x`` (a QuantizedKernel's values and scales alike) zero-padded on its last axis to ``width`` columns."""

    def pad(leaf):
        extra = width - leaf.shape[-1]
        return leaf if extra == 0 else jnp.pad(leaf, [(0, 0)] * (leaf.ndim - 1) + [(0, extra)])

    return map_columns(pad, x)


def own_kernel_block(up_proj_kernel: Kernel, *, hidden_size: int, weight_layout: str, axis_name: AxisName) -> Kernel:
    """This rank's column block [L, Hb] of the up projection (inside ``jax.shard_map``): the local kernel for
    "column"; for "replicated" a slice of the whole kernel, padded first when H % p != 0 (XLA may copy it per call)."""
    if weight_layout == "column":
        return up_proj_kernel
    tp_size = lax.axis_size(axis_name)
    block_width = column_block_width(hidden_size, tp_size)
    start = lax.axis_index(axis_name) * block_width
    return map_columns(lambda x: lax.dynamic_slice_in_dim(x, start, block_width, axis=-1),
                       pad_columns(up_proj_kernel, block_width * tp_size))


def project_all_columns(
    latent: jax.Array, up_proj_kernel: Kernel, *, hidden_size: int, weight_layout: str, axis_name: AxisName,
    fp8_activations: bool = False,
) -> jax.Array:
    """``latent @ W`` for all H columns on every rank, [T, L] x [L, H] -> [T, H]."""
    projected = project_own_columns(latent, up_proj_kernel, weight_layout=weight_layout,
                                    fp8_activations=fp8_activations)
    return gather_columns(projected, hidden_size=hidden_size, weight_layout=weight_layout, axis_name=axis_name)


def project_own_columns(
    latent: jax.Array, up_proj_kernel: Kernel, *, weight_layout: str, fp8_activations: bool = False
) -> jax.Array:
    """This rank's GEMM: [T, L] x [L, H] -> float32 [T, H] ("replicated"), or [T, L] x [L, Hb] -> [T, Hb] in the
    latent's dtype ("column", 1/p of the FLOPs and weight bytes)."""
    projected = project(latent, up_proj_kernel, fp8_activations=fp8_activations)
    return projected if weight_layout == "replicated" else projected.astype(latent.dtype)


def gather_columns(projected: jax.Array, *, hidden_size: int, weight_layout: str, axis_name: AxisName) -> jax.Array:
    """All H columns on every rank: for "column" an all-gather of the [T, Hb] blocks (not of the kernel's 2LH)."""
    if weight_layout == "replicated":
        return projected
    return assemble_column_blocks(projected, hidden_size=hidden_size, token_sharded=False, axis_name=axis_name)


def assemble_column_blocks(own: jax.Array, *, hidden_size: int, token_sharded: bool, axis_name: AxisName) -> jax.Array:
    """y from every rank's column block ``own`` [T, Hb], padding sliced off: an all-gather to [T, H], or for
    token-sharded output (T % p == 0) an all-to-all to this rank's [T/p, H] rows."""
    with jax.named_scope(OUTPUT_GATHER):
        if token_sharded:
            return lax.all_to_all(own, axis_name, split_axis=0, concat_axis=1, tiled=True)[:, :hidden_size]
        return lax.all_gather(own, axis_name, axis=1, tiled=True, to="invarying")[:, :hidden_size]
