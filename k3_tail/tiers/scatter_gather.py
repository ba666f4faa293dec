"""The scatter-gather tier: vLLM's fused tier-0 op expressed with standard collectives."""

from __future__ import annotations

from types import MappingProxyType

import jax
from jax import lax

from k3_tail._checks import AxisName
from k3_tail.config import TailConfig
from k3_tail.ops.collectives import reduce_scatter
from k3_tail.ops.columns import assemble_column_blocks, own_kernel_block, pad_columns
from k3_tail.ops.norm import allreduce_norm_latent_out
from k3_tail.ops.up_projection import project
from k3_tail.tiers.record import REDUCE_SCATTER, CallShape, CollectiveTerm, TierRecord
from k3_tail.ops.scopes import SHARED_REDUCTION
from k3_tail.ops.tokens import add_shared


def scatter_gather_tail(
    routed_partial: jax.Array,
    shared_partial: jax.Array | None,
    norm_weight: jax.Array | None,
    up_proj_kernel: jax.Array,
    *,
    config: TailConfig,
    axis_name: AxisName,
    weight_layout: str,
    platform: str | None = None,
) -> jax.Array:
    """AR(r) + norm; RS(s) over columns; shard GEMM + add on the own block; AG of the blocks.

    Inside ``jax.shard_map``. Per rank: routed_partial [T, L], shared_partial [T, H] or None,
    norm_weight [L] or None, up_proj_kernel [L, H] ("replicated") or this rank's [L, Hb] block
    ("column"), Hb = ceil(H / p); rank k's block is columns [k*Hb, (k+1)*Hb), the block that
    the reduce-scatter hands it.

    Returns y [T, H] in ``config.dtype``, identical on every rank. For sequence-parallel output
    (T % p == 0) an all-to-all replaces the AG: rank k sends token block j of its column block to
    rank j and gets its own [T/p, H] rows (AR(T*L), RS(T*H), all-to-all of (p-1)/p * T*H/p).
    Cost per rank, either layout: 2TLH/p GEMM FLOPs, 2LH/p weight bytes, AR(T*L), RS(T*H), AG(T*H):
    the same bytes as one AR(T*H), but the add runs on 1/p of the columns and the GEMM can start
    as soon as the latent is ready. With ``config.shared_output_is_reduced`` shared_partial is the
    reduced shared output (:func:`k3_tail.reduce_shared`'s form): no RS, and it is added to the
    assembled rows. On ``platform`` "rocm" the reduced block is added after the GEMM, never in it
    (:func:`k3_tail.ops.tokens.add_shared`).
    """
    latent = allreduce_norm_latent_out(routed_partial, norm_weight, config=config, axis_name=axis_name,
                                       platform=platform)
    block = own_kernel_block(
        up_proj_kernel, hidden_size=config.hidden_size, weight_layout=weight_layout, axis_name=axis_name
    )
    own = project(latent, block, fp8_activations=config.fp8_activations)
    if shared_partial is not None and not config.shared_output_is_reduced:
        padded = pad_columns(shared_partial, block.shape[1] * lax.axis_size(axis_name))
        with jax.named_scope(SHARED_REDUCTION):
            shared = reduce_scatter(padded, axis_name=axis_name, config=config, scatter_dimension=1)
            own = add_shared(own, shared, config=config, platform=platform)
    y = assemble_column_blocks(own.astype(config.dtype), hidden_size=config.hidden_size,
                               token_sharded=config.sequence_parallel, axis_name=axis_name)
    if config.shared_output_is_reduced:
        y = add_shared(y, shared_partial, config=config, platform=platform)
    return y


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    blocks = shape.rows * shape.tp_size * shape.block_width
    scatter = (CollectiveTerm(REDUCE_SCATTER, blocks, beside_gemm=True),) if shape.sums_shared else ()
    return shape.latent_reduction() + scatter + (shape.block_assembly(),)


RECORD = TierRecord(
    name="scatter_gather",
    function=scatter_gather_tail,
    summary="vLLM's fused tier-0 op in standard collectives: reduce-scatter s, shard GEMM + add, all-gather",
    schedule="AR(r) + norm; RS(s) over columns; shard GEMM + add; AG",
    collectives_text="AR(TL), RS(TH) beside the GEMM, AG(TH)",
    projects_all_columns=False,
    token_sharded_form="the final all-gather over columns becomes an all-to-all from columns to tokens",
    shared_reduced_form="RS(s) is left out: the own block's projection is assembled and the reduced shared output "
                        "added to it",
    collectives=_collectives,
    # Async collectives pinned on, for the reduce-scatter that runs beside the GEMM.
    compiler_options=MappingProxyType({"gpu": MappingProxyType({"xla_gpu_disable_async_collectives": ""})}),
)
