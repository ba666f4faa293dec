"""The overlap tier (vLLM tier 1): the shared all-reduce in flight while the up projection runs.

Summary: vLLM tier 1: the shared all-reduce in flight while the up projection runs
Schedule: AR(r) + norm; AR(s) started; GEMM; AR(s) done; add
Collectives: AR(TL), AR(TH) beside the GEMM (column layout: + AG(TH) of the output blocks)
Token-sharded output: AR(s) becomes a reduce-scatter over tokens and each rank keeps its rows of the projection
Shared output reduced: nothing is left to overlap: the reduced shared output is added, as native does
"""

from __future__ import annotations

from types import MappingProxyType

import jax
from jax import lax

from k3_tail.ops.columns import gather_columns, project_own_columns
from k3_tail.ops.tokens import own_tokens
from k3_tail.tiers.context import TailCall
from k3_tail.tiers.record import CallShape, CollectiveTerm, GpuKernelCounts, TierRecord


def overlap_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, call: TailCall) -> jax.Array:
    """The tier's :class:`~k3_tail.tiers.context.TierFunction`. Cost per rank: native's, AR(T*H) behind the GEMM."""
    config = call.config
    latent = call.normalised_latent(routed_partial, norm_weight)
    projected = project_own_columns(latent, up_proj_kernel, weight_layout=call.weight_layout,
                                    fp8_activations=config.fp8_activations)
    shared = None
    if shared_partial is not None and config.shared_output_is_reduced:
        shared = shared_partial  # reduced before the tail: nothing is left to overlap
    elif shared_partial is not None:
        # The shared partial waits for the normalised latent, so XLA's combiner cannot merge the two all-reduces
        # into one synchronous all-reduce before the GEMM. The barriers order values only: they emit no kernel.
        _, shared_partial = lax.optimization_barrier((latent, shared_partial))
        shared = call.shared_output(shared_partial)
        # The column layout's all-gather waits for the shared all-reduce, which leaves the GEMM as the
        # only work to schedule inside it (else XLA may run the GEMM first and hide the all-gather).
        _, projected = lax.optimization_barrier((shared, projected))
    projected = gather_columns(projected, hidden_size=config.hidden_size, weight_layout=call.weight_layout,
                               axis_name=call.axis_name)
    if call.token_sharded:
        projected = own_tokens(projected, axis_name=call.axis_name)
    return call.add_shared(projected, shared)


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    shared = ()
    if shape.sums_shared:
        shared = (CollectiveTerm(shape.output_reduction, shape.rows * shape.hidden_size, beside_gemm=True),)
    return shape.latent_reduction() + shared + shape.column_gather()


RECORD = TierRecord(
    function=overlap_tail,
    projects_all_columns=True,
    collectives=_collectives,
    gpu_kernels=GpuKernelCounts(column=dict(cuda=(7, 5), rocm=(7, 5)), replicated=dict(cuda=(7, 4), rocm=(6, 4))),
    # In a program of several tails XLA would combine the shared all-reduce (and a quantised sum's second shot,
    # an all-gather) with others before the GEMM, and nothing would overlap. The latency-hiding scheduler moves
    # the GEMM inside the async pair: XLA's default for CUDA, for ROCm only from jax 0.12 on.
    compiler_options=MappingProxyType({"gpu": MappingProxyType({
        "xla_gpu_all_reduce_combine_threshold_bytes": 0, "xla_gpu_all_gather_combine_threshold_bytes": 0,
        "xla_gpu_disable_async_collectives": "", "xla_gpu_enable_latency_hiding_scheduler": True,
    })}),
)
