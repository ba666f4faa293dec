"""The one_kernel tier: column_parallel's schedule with its local work in ONE GPU kernel (Pallas, Triton backend).

Pallas's Triton backend is the only Pallas GPU backend on ROCm (Mosaic GPU refuses AMD devices); where a jax
lacks it the record says why not. On a CPU the kernel runs interpreted: correct, slow, so selected on GPUs only.

Summary: column_parallel's schedule with the norm, the own column block of the GEMM and the add in one Pallas
    kernel: one GPU kernel per call besides the two all-reduces
Schedule: AR(r); ONE kernel: norm, own column block of the GEMM, added into own columns of s; AR
Collectives: AR(TL), AR(TH)
Token-sharded output: the final AR becomes a reduce-scatter over tokens
Shared output reduced: the kernel adds the own block into the reduced shared output's own columns and an AG
    assembles the blocks (an all-to-all to token rows, then the add, for token-sharded output)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_tail.config import TailConfig
from k3_tail.ops.columns import assemble_column_blocks, column_block_width
from k3_tail.ops.fused_launch import COMPILED_ON, LARGEST_ROW_TILE, FusedGrid, fused_grid
from k3_tail.ops.fused_projection import BlockProjection, norm_project_add, norm_project_add_into, triton_unavailable
from k3_tail.ops.pallas_triton import ignore_triton_deprecation_warning
from k3_tail.ops.scopes import SHARED_REDUCTION, UP_PROJECTION
from k3_tail.tiers import column_parallel
from k3_tail.tiers.context import TailCall
from k3_tail.tiers.record import GpuKernelCounts, OwnKernel, TierRecord


def one_kernel_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, call: TailCall) -> jax.Array:
    """The tier's :class:`~k3_tail.tiers.context.TierFunction`. Cost per rank, either layout: 2TLH/p FLOPs, 2LH/p
    weight bytes read where they lie, AR(T*L) then AR(T*H), one kernel."""
    config = call.config
    hidden = config.hidden_size
    latent = call.reduced_latent(routed_partial)
    norm_weight = norm_weight if config.use_latent_norm else None
    options = _kernel_options(call)
    if not config.shared_output_is_reduced:
        buffer = shared_partial if shared_partial is not None else jnp.zeros((latent.shape[0], hidden), config.dtype)
        with jax.named_scope(UP_PROJECTION):
            summed = norm_project_add_into(latent, norm_weight, up_proj_kernel, buffer, **options)
        return call.reduce_output(summed, scope=SHARED_REDUCTION)
    # Token-sharded, this rank's shared rows are not its columns' rows: the blocks go to token rows, then the add.
    with jax.named_scope(UP_PROJECTION):
        own = norm_project_add(latent, norm_weight, up_proj_kernel, None if call.token_sharded else shared_partial,
                               **options)
    assembled = assemble_column_blocks(own, hidden_size=hidden, token_sharded=call.token_sharded,
                                       axis_name=call.axis_name)
    return call.add_shared(assembled, shared_partial) if call.token_sharded else assembled


def _kernel_options(call: TailCall) -> dict:
    config = call.config
    projection = BlockProjection(tp_size=call.tp_size, hidden_size=config.hidden_size, eps=config.rms_norm_eps,
                                 scale=config.routed_scaling_factor)
    return dict(rank=call.rank_index(), projection=projection,
                # Interpreted (a CPU), the kernel does not split K (the split's path is tested on the kernel).
                interpret=RECORD.runs_interpreted_on(call.platform), platform=call.platform)


def _launch_grid(config: TailConfig, num_tokens: int, tp_size: int) -> FusedGrid:
    return fused_grid(num_tokens, config.latent_size, column_block_width(config.hidden_size, tp_size))


def _scratch_bytes(config: TailConfig, num_tokens: int, tp_size: int) -> int:
    return _launch_grid(config, num_tokens, tp_size).scratch_bytes(num_tokens)


def _why_not(config: TailConfig | None) -> str | None:
    if config is not None and config.fp8_activations:
        return ("one_kernel reads FP8 weights but multiplies in the activation dtype: fp8_activations=True (FP8 x FP8 "
                "GEMMs) is served by the other tiers")
    unavailable = triton_unavailable()
    return None if unavailable is None else f"one_kernel needs Pallas's Triton backend: {unavailable}"


RECORD = TierRecord(
    function=one_kernel_tail,
    projects_all_columns=False,
    collectives=column_parallel.RECORD.collectives,
    gpu_kernels=GpuKernelCounts(column=dict(cuda=(1, 1), rocm=(1, 1)), replicated=dict(cuda=(1, 1), rocm=(1, 1))),
    unavailable=_why_not,
    reads_rank=True,
    own_kernel=OwnKernel(compiled_on=COMPILED_ON, rows_per_weight_read=LARGEST_ROW_TILE, launch_grid=_launch_grid,
                         scratch_bytes=_scratch_bytes, lowering_setup=ignore_triton_deprecation_warning),
)
