"""Column blocks of the up projection: weight layouts, padding, and each rank's own block.

Rank k owns the columns [k*Hb, (k+1)*Hb) of the [L, H] kernel, Hb = ceil(H / p). When H % p != 0 the
kernel and the shared partial are padded with zero columns to p*Hb and the result sliced back to H, so
no column is dropped (vLLM's CUDA tier 2 drops the last H mod p). Layouts: "replicated" (every rank
holds the whole kernel, vLLM's layout: 2LH bytes per rank) and "column" (rank k holds its [L, Hb]
block, ``P(None, axis)``: 2LH/p bytes); a :class:`k3_tail.QuantizedKernel` holds half of those.
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
    """The width the column tiers shard: a column-layout kernel is stored [L, padded_hidden_size(H, p)].

    Args:
      hidden_size: H.
      tp_size: p.

    Returns:
      ``hidden_size`` rounded up to a multiple of ``tp_size``; the extra columns are zero.

    Raises:
      ValueError: naming the argument, unless both are integers >= 1.
    """
    hidden_size = check_int("hidden_size", hidden_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    return -(-hidden_size // tp_size) * tp_size


def pad_columns(x: Kernel, width: int) -> Kernel:
    """``x`` with zero columns appended on its last axis up to ``width`` (no-op when already there);
    for a QuantizedKernel, its values and scales alike."""

    def pad(leaf):
        extra = width - leaf.shape[-1]
        return leaf if extra == 0 else jnp.pad(leaf, [(0, 0)] * (leaf.ndim - 1) + [(0, extra)])

    return map_columns(pad, x)


def own_kernel_block(up_proj_kernel: Kernel, *, hidden_size: int, weight_layout: str, axis_name: AxisName) -> Kernel:
    """This rank's column block [L, Hb] of the up projection (inside ``jax.shard_map``): the local
    kernel itself for "column"; for "replicated" sliced out of the whole kernel (2*L*Hb bytes read),
    padded first when H % p != 0, which XLA may materialise per call."""
    if weight_layout == "column":
        return up_proj_kernel
    tp_size = lax.axis_size(axis_name)
    block_width = padded_hidden_size(hidden_size, tp_size) // tp_size
    start = lax.axis_index(axis_name) * block_width
    return map_columns(lambda x: lax.dynamic_slice_in_dim(x, start, block_width, axis=-1),
                       pad_columns(up_proj_kernel, block_width * tp_size))


def project_all_columns(
    latent: jax.Array, up_proj_kernel: Kernel, *, hidden_size: int, weight_layout: str, axis_name: AxisName,
    fp8_activations: bool = False,
) -> jax.Array:
    """``latent @ W`` for all H columns on every rank, [T, L] x [L, H] -> [T, H]:
    :func:`project_own_columns`, then :func:`gather_columns`."""
    projected = project_own_columns(latent, up_proj_kernel, weight_layout=weight_layout,
                                    fp8_activations=fp8_activations)
    return gather_columns(projected, hidden_size=hidden_size, weight_layout=weight_layout, axis_name=axis_name)


def project_own_columns(
    latent: jax.Array, up_proj_kernel: Kernel, *, weight_layout: str, fp8_activations: bool = False
) -> jax.Array:
    """This rank's GEMM: [T, L] x [L, H] -> float32 [T, H] ("replicated": 2TLH FLOPs, 2LH weight bytes),
    or [T, L] x [L, Hb] -> [T, Hb] in the latent's dtype ("column": 2TLH/p FLOPs, 2LH/p weight bytes).
    The GEMM is :func:`k3_tail.ops.up_projection.project` (FP8 kernels: half the weight bytes)."""
    projected = project(latent, up_proj_kernel, fp8_activations=fp8_activations)
    return projected if weight_layout == "replicated" else projected.astype(latent.dtype)


def gather_columns(projected: jax.Array, *, hidden_size: int, weight_layout: str, axis_name: AxisName) -> jax.Array:
    """All H columns on every rank from :func:`project_own_columns`' result: nothing to do for
    "replicated"; for "column" an all-gather of the [T, Hb] blocks (2TH bytes, where gathering the
    kernel would move 2LH per call)."""
    if weight_layout == "replicated":
        return projected
    return assemble_column_blocks(projected, hidden_size=hidden_size, token_sharded=False, axis_name=axis_name)


def assemble_column_blocks(own: jax.Array, *, hidden_size: int, token_sharded: bool, axis_name: AxisName) -> jax.Array:
    """y from every rank's column block ``own`` [T, Hb], named ``k3_tail/output_gather``, padding columns
    sliced off: an all-gather to [T, H] on every rank, or for token-sharded output (T % p == 0) an
    all-to-all from column blocks to this rank's [T/p, H] rows (1/p of the all-gather's bytes)."""
    with jax.named_scope(OUTPUT_GATHER):
        if token_sharded:
            return lax.all_to_all(own, axis_name, split_axis=0, concat_axis=1, tiled=True)[:, :hidden_size]
        return lax.all_gather(own, axis_name, axis=1, tiled=True, to="invarying")[:, :hidden_size]
