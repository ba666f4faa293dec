"""The overlap tier (vLLM tier 1): the shared all-reduce in flight while the up projection runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail.columns import project_all_columns
from k3_tail.config import TailConfig
from k3_tail.norm import allreduce_norm_latent_out


def overlap_tail(
    routed_partial: jax.Array,
    shared_partial: jax.Array | None,
    norm_weight: jax.Array | None,
    up_proj_kernel: jax.Array,
    *,
    config: TailConfig,
    axis_name: str,
    weight_layout: str,
) -> jax.Array:
    """AR(s) issued first; AR(r) + norm; GEMM while AR(s) is in flight; add. Inside ``jax.shard_map``.

    Per rank: routed_partial [T, L], shared_partial [T, H] or None, norm_weight [L] or None,
    up_proj_kernel [L, H] ("replicated") or this rank's [L, Hb] block ("column").
    Returns y [T, H] in ``config.dtype``, identical on every rank.

    Cost per rank: as the native tier (replicated: 2TLH FLOPs, 2LH weight bytes, AR(T*L) + AR(T*H);
    column: 2TLH/p FLOPs, 2LH/p weight bytes and an all-gather of the [T, H/p] output blocks), but
    the shared all-reduce depends on nothing else, so it can hide behind the GEMM. Whether XLA
    overlaps it is the backend scheduler's decision: on GPU its all-reduce combiner may merge the
    two all-reduces into one synchronous collective (spec, section 7).
    """
    shared = None if shared_partial is None else lax.psum(shared_partial, axis_name)
    latent = allreduce_norm_latent_out(routed_partial, norm_weight, config=config, axis_name=axis_name)
    projected = project_all_columns(
        latent, up_proj_kernel, hidden_size=config.hidden_size, weight_layout=weight_layout, axis_name=axis_name
    )
    if shared is None:
        return projected.astype(config.dtype)
    return (projected.astype(jnp.float32) + shared.astype(jnp.float32)).astype(config.dtype)
