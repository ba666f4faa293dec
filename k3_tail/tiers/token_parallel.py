"""The token-parallel tier (vLLM's ROCm prefill tail): every collective splits tokens, none reduces whole.

Not for decode: every rank needs the whole kernel, and T/p rows of a small T leave the GEMM nothing to do.

Summary: vLLM's ROCm prefill tail: routed and shared partials reduce-scattered over tokens; each rank normalises and
    projects its own T/p rows with the whole kernel
Schedule: RS(r) over tokens; norm of own rows; RS(s) over tokens; own rows GEMM + add; AG over tokens (replicated
    output only)
Collectives: RS(TL), RS(TH), + AG(TH) for replicated output
Token-sharded output: the final all-gather over tokens is left out: each rank keeps its own rows
Shared output reduced: RS(s) is left out: each rank takes its own rows of the reduced shared output
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_tail.ops.norm import rms_norm
from k3_tail.ops.scopes import LATENT_REDUCTION, SHARED_REDUCTION
from k3_tail.ops.tokens import gather_tokens, own_tokens, pad_tokens
from k3_tail.tiers.context import TailCall
from k3_tail.tiers.record import ALL_GATHER, REDUCE_SCATTER, CallShape, CollectiveTerm, GpuKernelCounts, TierRecord


def token_parallel_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, call: TailCall) -> jax.Array:
    """The tier's :class:`~k3_tail.tiers.context.TierFunction`; needs the whole kernel and unreduced routed
    partials. T is zero-padded to T', a multiple of p (zero rows stay zero through the norm). Cost per rank:
    2(T'/p)LH GEMM FLOPs, 2LH weight bytes, RS(T'*L), RS(T'*H) and, for replicated output, AG(T'*H)."""
    config = call.config
    RECORD.check_runs(call.weight_layout, config)
    num_tokens = routed_partial.shape[0]
    if num_tokens == 0:  # nothing to split (sequence-parallel output arrives padded to p rows)
        return jnp.zeros((0, config.hidden_size), config.dtype)

    def own_rows(x, scope):
        with jax.named_scope(scope):
            return call.reduce_scatter(pad_tokens(x, call.tp_size), scatter_dimension=0)

    weight = norm_weight if config.use_latent_norm else None
    latent = rms_norm(own_rows(routed_partial, LATENT_REDUCTION), weight, eps=config.rms_norm_eps,
                      scale=config.routed_scaling_factor)
    y = call.project(latent.astype(config.dtype), up_proj_kernel)
    shared = None
    if shared_partial is not None:
        if not config.shared_output_is_reduced:
            shared = own_rows(shared_partial, SHARED_REDUCTION)
        elif call.token_sharded:
            shared = shared_partial  # already this rank's rows
        else:
            shared = own_tokens(pad_tokens(shared_partial, call.tp_size), axis_name=call.axis_name)
    y = call.add_shared(y, shared)
    if call.token_sharded:
        return y
    return gather_tokens(y, num_tokens, axis_name=call.axis_name)


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    terms = [CollectiveTerm(REDUCE_SCATTER, shape.rows * shape.latent_size)]
    if shape.sums_shared:
        terms.append(CollectiveTerm(REDUCE_SCATTER, shape.rows * shape.hidden_size))
    if not shape.token_sharded:
        terms.append(CollectiveTerm(ALL_GATHER, shape.rows * shape.hidden_size))
    return tuple(terms)


RECORD = TierRecord(
    function=token_parallel_tail,
    projects_all_columns=True,
    splits_tokens=True,
    collectives=_collectives,
    gpu_kernels=GpuKernelCounts(replicated=dict(cuda=(7, 3), rocm=(7, 3))),
    needs_whole_kernel=True,
    serves_routed_output_is_reduced=False,
)
