"""The one-collective tier: the norm is a per-row scale, so it can be applied after the GEMM.

    y = sum_i s_i + c * rsqrt(mean((c x)^2) + eps) * sum_i ((r_i * g) @ W),   x = sum_i r_i

Without a norm the partials are scaled, (c r_i) @ W, and x is not sent.

Summary: not in vLLM: the norm applied after the GEMM as a row scale, so one all-reduce replaces two
Schedule: own (r g) projected; ONE AR of the packed [(r g) @ W | s | r]; row RMS factor (with c) applied after
Collectives: AR(T(2H+L)): one collective instead of two serial ones
Token-sharded output: the packed all-reduce becomes a reduce-scatter over tokens
Shared output reduced: the packed all-reduce loses s (T(H+L) elements); the reduced shared output is added after it
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_tail.ops.norm import inverse_rms
from k3_tail.ops.scopes import PACKED_REDUCTION
from k3_tail.tiers.context import TailCall
from k3_tail.tiers.record import CallShape, CollectiveTerm, GpuKernelCounts, TierRecord


def one_shot_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, call: TailCall) -> jax.Array:
    """The tier's :class:`~k3_tail.tiers.context.TierFunction`; needs the whole kernel ("replicated"). Cost per
    rank: 2TLH GEMM FLOPs, 2LH weight bytes, one collective of T*(2H + L) elements in ``config.dtype``."""
    config = call.config
    RECORD.check_runs(call.weight_layout, config)
    routed = routed_partial.astype(jnp.float32)
    # With the norm, c enters through the row factor (inverse_rms: c x may overflow float32 where x does not);
    # without it, through the partials.
    if config.use_latent_norm:
        weighted = routed * norm_weight.astype(jnp.float32)
    else:
        weighted = config.routed_scaling_factor * routed
    projected = call.project(weighted.astype(config.dtype), up_proj_kernel)
    hidden = config.hidden_size
    sums_shared = shared_partial is not None and not config.shared_output_is_reduced
    parts = [projected.astype(config.dtype)]
    if sums_shared:
        parts.append(shared_partial)
    if config.use_latent_norm:
        parts.append(routed_partial)
    packed = call.reduce_output(jnp.concatenate(parts, axis=1), scope=PACKED_REDUCTION).astype(jnp.float32)
    y = packed[:, :hidden]
    if config.use_latent_norm:
        y = y * inverse_rms(packed[:, -config.latent_size:], eps=config.rms_norm_eps,
                            scale=config.routed_scaling_factor)
    if sums_shared:
        y = y + packed[:, hidden:2 * hidden]
    elif shared_partial is not None:  # the reduced shared output, in this rank's form
        y = y + shared_partial.astype(jnp.float32)
    return y.astype(config.dtype)


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    packed = shape.hidden_size + (shape.hidden_size if shape.sums_shared else 0)
    packed += shape.latent_size if shape.use_norm else 0
    return (CollectiveTerm(shape.output_reduction, shape.rows * packed),)


RECORD = TierRecord(
    function=one_shot_tail,
    projects_all_columns=True,
    collectives=_collectives,
    gpu_kernels=GpuKernelCounts(replicated=dict(cuda=(5, 5), rocm=(5, 5))),
    needs_whole_kernel=True,
    serves_routed_output_is_reduced=False,
)
