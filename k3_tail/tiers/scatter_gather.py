"""The scatter-gather tier: vLLM's fused tier-0 op expressed with standard collectives.

Summary: vLLM's fused tier-0 op in standard collectives: reduce-scatter s, shard GEMM + add, all-gather
Schedule: AR(r) + norm; RS(s) over columns; shard GEMM + add; AG
Collectives: AR(TL), RS(TH) beside the GEMM, AG(TH)
Token-sharded output: the final all-gather over columns becomes an all-to-all from columns to tokens
Shared output reduced: RS(s) is left out: the own block's projection is assembled and the reduced shared output
    added to it
"""

from __future__ import annotations

from types import MappingProxyType

import jax

from k3_tail.ops.columns import assemble_column_blocks, own_kernel_block, pad_columns
from k3_tail.ops.scopes import SHARED_REDUCTION
from k3_tail.tiers.context import TailCall
from k3_tail.tiers.record import REDUCE_SCATTER, CallShape, CollectiveTerm, GpuKernelCounts, TierRecord


def scatter_gather_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, call: TailCall) -> jax.Array:
    """The tier's :class:`~k3_tail.tiers.context.TierFunction`. Cost per rank, either layout: 2TLH/p GEMM FLOPs,
    2LH/p weight bytes, AR(T*L), RS(T*H), AG(T*H)."""
    config = call.config
    latent = call.normalised_latent(routed_partial, norm_weight)
    block = own_kernel_block(
        up_proj_kernel, hidden_size=config.hidden_size, weight_layout=call.weight_layout, axis_name=call.axis_name
    )
    own = call.project(latent, block)
    if shared_partial is not None and not config.shared_output_is_reduced:
        padded = pad_columns(shared_partial, block.shape[1] * call.tp_size)
        with jax.named_scope(SHARED_REDUCTION):
            own = call.add_shared(own, call.reduce_scatter(padded, scatter_dimension=1))
    y = assemble_column_blocks(own.astype(config.dtype), hidden_size=config.hidden_size,
                               token_sharded=call.token_sharded, axis_name=call.axis_name)
    if config.shared_output_is_reduced:
        y = call.add_shared(y, shared_partial)
    return y


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    blocks = shape.rows * shape.tp_size * shape.block_width
    scatter = (CollectiveTerm(REDUCE_SCATTER, blocks, beside_gemm=True),) if shape.sums_shared else ()
    return shape.latent_reduction() + scatter + (shape.block_assembly(),)


RECORD = TierRecord(
    function=scatter_gather_tail,
    projects_all_columns=False,
    collectives=_collectives,
    gpu_kernels=GpuKernelCounts(column=dict(cuda=(5, 5), rocm=(6, 6)), replicated=dict(cuda=(6, 6), rocm=(7, 7))),
    # Async collectives pinned on, for the reduce-scatter that runs beside the GEMM.
    compiler_options=MappingProxyType({"gpu": MappingProxyType({"xla_gpu_disable_async_collectives": ""})}),
)
