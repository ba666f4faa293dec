"""The column-parallel tier (vLLM tier 2): one final all-reduce stitches the column blocks.

Summary: vLLM tier 2: each rank adds its column block of the projection into its own shared partial; one all-reduce
    stitches and sums
Schedule: AR(r) + norm; own column block of the GEMM added into own columns of s; AR
Collectives: AR(TL), AR(TH)
Token-sharded output: the final AR becomes a reduce-scatter over tokens
Shared output reduced: the final AR has nothing left to sum and becomes an AG of the column blocks (an all-to-all to
    token rows for token-sharded output); the reduced shared output is added
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail.ops.columns import assemble_column_blocks, own_kernel_block, pad_columns
from k3_tail.ops.scopes import SHARED_REDUCTION
from k3_tail.tiers.context import TailCall
from k3_tail.tiers.record import CallShape, CollectiveTerm, GpuKernelCounts, TierRecord


def column_parallel_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, call: TailCall) -> jax.Array:
    """The tier's :class:`~k3_tail.tiers.context.TierFunction`. Cost per rank, either layout: 2TLH/p GEMM FLOPs,
    2LH/p weight bytes, AR(T*L) then AR(T*H), serial."""
    if not call.config.shared_output_is_reduced:
        buffer = stitched_buffer(routed_partial, shared_partial, norm_weight, up_proj_kernel, call)
        return call.reduce_output(buffer, scope=SHARED_REDUCTION)
    config = call.config
    latent = call.normalised_latent(routed_partial, norm_weight)
    own = call.project(latent, _own_block(up_proj_kernel, call)).astype(config.dtype)
    # Nothing is left to sum, so the stitch is an all-gather of the blocks: half an all-reduce's bytes.
    projected = assemble_column_blocks(own, hidden_size=config.hidden_size, token_sharded=call.token_sharded,
                                       axis_name=call.axis_name)
    return call.add_shared(projected, shared_partial)


def stitched_buffer(routed_partial, shared_partial, norm_weight, up_proj_kernel, call: TailCall) -> jax.Array:
    """The [T, H] buffer this rank hands to the final all-reduce: the shared partial (zeros without one) with
    latent @ block added (float32, rounded once) into its columns [k*Hb, min((k+1)*Hb, H))."""
    config = call.config
    latent = call.normalised_latent(routed_partial, norm_weight)
    block = _own_block(up_proj_kernel, call)
    block_width = block.shape[1]
    start = lax.axis_index(call.axis_name) * block_width
    if shared_partial is None:
        shared_partial = jnp.zeros((latent.shape[0], config.hidden_size), config.dtype)
    buffer = pad_columns(shared_partial, block_width * call.tp_size)
    own = call.add_shared(call.project(latent, block), lax.dynamic_slice_in_dim(buffer, start, block_width, axis=1))
    buffer = lax.dynamic_update_slice_in_dim(buffer, own, start, axis=1)
    # Padding columns are sliced off before the collective, so it moves T*H, not T*p*Hb.
    return buffer[:, : config.hidden_size]


def _own_block(up_proj_kernel, call: TailCall):
    return own_kernel_block(up_proj_kernel, hidden_size=call.config.hidden_size, weight_layout=call.weight_layout,
                            axis_name=call.axis_name)


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    if shape.shared_output_is_reduced:
        return shape.latent_reduction() + (shape.block_assembly(),)
    # The [T, H] buffer is reduced with or without shared experts: it carries the column blocks.
    return shape.latent_reduction() + (CollectiveTerm(shape.output_reduction, shape.rows * shape.hidden_size),)


RECORD = TierRecord(
    function=column_parallel_tail,
    projects_all_columns=False,
    collectives=_collectives,
    gpu_kernels=GpuKernelCounts(column=dict(cuda=(6, 4), rocm=(7, 5)), replicated=dict(cuda=(7, 5), rocm=(8, 6))),
)
