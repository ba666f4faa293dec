"""The column-parallel tier (vLLM tier 2): one final all-reduce stitches the column blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName
from k3_tail.config import TailConfig
from k3_tail.ops.columns import assemble_column_blocks, own_kernel_block, pad_columns
from k3_tail.ops.norm import allreduce_norm_latent_out
from k3_tail.ops.up_projection import project
from k3_tail.tiers.record import CallShape, CollectiveTerm, TierRecord
from k3_tail.ops.scopes import SHARED_REDUCTION
from k3_tail.ops.tokens import add_shared, reduce_output


def column_parallel_tail(
    routed_partial: jax.Array,
    shared_partial: jax.Array | None,
    norm_weight: jax.Array | None,
    up_proj_kernel: jax.Array,
    *,
    config: TailConfig,
    axis_name: AxisName,
    weight_layout: str,
    platform: str | None = None,
    defer_all_reduce: bool = False,
) -> jax.Array:
    """AR(r) + norm; rank k adds latent @ W[:, block k] into block k of its shared partial; AR.

    Inside ``jax.shard_map``. Per rank: routed_partial [T, L], shared_partial [T, H] or None (zeros),
    norm_weight [L] or None, up_proj_kernel [L, H] ("replicated") or this rank's [L, Hb] block
    ("column"), Hb = ceil(H / p).

    Contract: the buffer handed to the final all-reduce equals the shared partial
    everywhere except this rank's columns [k*Hb, min((k+1)*Hb, H)), which hold shared + latent @ block
    (added in float32, rounded once). Summed over ranks, every column gets its projection exactly once.
    With ``defer_all_reduce=True`` that per-rank [T, H] buffer is returned instead of y, for a caller
    that folds the reduction into a later collective (out_specs must then be per-rank).

    Returns y [T, H] in ``config.dtype``, identical on every rank. For sequence-parallel output
    (T % p == 0) the final AR is a reduce-scatter over tokens and this rank gets its [T/p, H] rows.
    With ``config.shared_output_is_reduced`` shared_partial is the reduced shared output
    (:func:`k3_tail.reduce_shared`'s form): the final collective has nothing left to sum, so it is an
    all-gather of the [T, Hb] projection blocks (an all-to-all to token rows for sequence-parallel
    output), and the reduced shared output is added after it.
    Cost per rank, either layout: 2TLH/p GEMM FLOPs, 2LH/p weight bytes, AR(T*L) then AR(T*H),
    serial. The replicated layout slices its block out of the whole kernel (which it keeps in memory).
    On ``platform`` "rocm" the GEMM's result is added to the shared block after the GEMM, never in it
    (:func:`k3_tail.ops.tokens.add_shared`); CUDA lets XLA fold the add into the GEMM.
    """
    if defer_all_reduce and config.shared_output_is_reduced:
        raise ValueError("defer_all_reduce: with shared_output_is_reduced the tier ends in an all-gather of the "
                         "column blocks, not in an all-reduce that a caller could fold")
    latent = allreduce_norm_latent_out(routed_partial, norm_weight, config=config, axis_name=axis_name,
                                       platform=platform)
    block = own_kernel_block(
        up_proj_kernel, hidden_size=config.hidden_size, weight_layout=weight_layout, axis_name=axis_name
    )
    if config.shared_output_is_reduced:
        # Nothing is left to sum, so the stitch is an all-gather of the blocks: half an all-reduce's bytes.
        own = project(latent, block, fp8_activations=config.fp8_activations).astype(config.dtype)
        projected = assemble_column_blocks(own, hidden_size=config.hidden_size,
                                           token_sharded=config.sequence_parallel, axis_name=axis_name)
        return add_shared(projected, shared_partial, config=config, platform=platform)
    block_width = block.shape[1]
    start = lax.axis_index(axis_name) * block_width
    if shared_partial is None:
        shared_partial = jnp.zeros((latent.shape[0], config.hidden_size), config.dtype)
    buffer = pad_columns(shared_partial, block_width * lax.axis_size(axis_name))
    own = add_shared(project(latent, block, fp8_activations=config.fp8_activations),
                     lax.dynamic_slice_in_dim(buffer, start, block_width, axis=1), config=config, platform=platform)
    buffer = lax.dynamic_update_slice_in_dim(buffer, own, start, axis=1)
    # Padding columns are sliced off before the collective, so it moves T*H, not T*p*Hb.
    buffer = buffer[:, : config.hidden_size]
    if defer_all_reduce:
        return buffer
    return reduce_output(buffer, axis_name=axis_name, config=config, platform=platform, scope=SHARED_REDUCTION)


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    if shape.shared_reduced:
        return shape.latent_reduction() + (shape.block_assembly(),)
    # The [T, H] buffer is reduced with or without shared experts: it carries the column blocks.
    return shape.latent_reduction() + (CollectiveTerm(shape.output_reduction, shape.rows * shape.hidden_size),)


RECORD = TierRecord(
    name="column_parallel",
    function=column_parallel_tail,
    summary="vLLM tier 2: each rank adds its column block of the projection into its own shared partial; "
            "one all-reduce stitches and sums",
    schedule="AR(r) + norm; own column block of the GEMM added into own columns of s; AR",
    collectives_text="AR(TL), AR(TH)",
    projects_all_columns=False,
    token_sharded_form="the final AR becomes a reduce-scatter over tokens",
    shared_reduced_form="the final AR has nothing left to sum and becomes an AG of the column blocks (an "
                        "all-to-all to token rows for token-sharded output); the reduced shared output is added",
    collectives=_collectives,
)
