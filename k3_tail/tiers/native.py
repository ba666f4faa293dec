"""The native tier: vLLM's base path and the reference semantics of the tail.

Summary: vLLM's base path and the reference semantics: every step after the one before it
Schedule: AR(r); norm; GEMM; AR(s); add
Collectives: AR(TL), AR(TH) (column layout: + AG(TH) of the output blocks)
Token-sharded output: AR(s) becomes a reduce-scatter over tokens and each rank keeps its rows of the projection
Shared output reduced: AR(s) is left out: the reduced shared output is added
"""

from __future__ import annotations

import jax

from k3_tail.ops.columns import project_all_columns
from k3_tail.ops.tokens import own_tokens
from k3_tail.tiers.context import TailCall
from k3_tail.tiers.record import CallShape, CollectiveTerm, GpuKernelCounts, TierRecord


def native_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, call: TailCall) -> jax.Array:
    """The tier's :class:`~k3_tail.tiers.context.TierFunction`. Cost per rank: 2TLH GEMM FLOPs, 2LH weight bytes
    (column layout: /p, plus AG of the output blocks), AR(T*L) and AR(T*H)."""
    config = call.config
    latent = call.normalised_latent(routed_partial, norm_weight)
    projected = project_all_columns(
        latent, up_proj_kernel, hidden_size=config.hidden_size, weight_layout=call.weight_layout,
        axis_name=call.axis_name, fp8_activations=config.fp8_activations,
    )
    if call.token_sharded:
        projected = own_tokens(projected, axis_name=call.axis_name)
    shared = None if shared_partial is None else call.shared_output(shared_partial)
    return call.add_shared(projected, shared)


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    shared = (CollectiveTerm(shape.output_reduction, shape.rows * shape.hidden_size),) if shape.sums_shared else ()
    return shape.latent_reduction() + shape.column_gather() + shared


RECORD = TierRecord(
    function=native_tail,
    projects_all_columns=True,
    collectives=_collectives,
    gpu_kernels=GpuKernelCounts(column=dict(cuda=(7, 6), rocm=(7, 6)), replicated=dict(cuda=(6, 4), rocm=(6, 5))),
)
