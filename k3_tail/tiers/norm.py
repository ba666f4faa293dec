"""The latent RMSNorm and the all-reduce + RMSNorm helper that every tier starts with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName
from k3_tail.config import TailConfig
from k3_tail.tiers.collectives import all_reduce
from k3_tail.tiers.scopes import LATENT_REDUCTION


def rms_norm(x: jax.Array, weight: jax.Array | None, *, eps: float, scale: float = 1.0) -> jax.Array:
    """``RMSNorm_weight(scale * x)`` over the last axis, in float32; returns float32.

    x: [..., L] any float dtype; weight: [L] or None (no norm: only the scale is applied).
    ``scale`` multiplies x before the norm (routed_scaling_factor), so with a norm it
    only matters through eps.
    """
    x = x.astype(jnp.float32) * scale
    if weight is None:
        return x
    return x * inverse_rms(x, eps=eps) * weight.astype(jnp.float32)


def inverse_rms(x: jax.Array, *, eps: float) -> jax.Array:
    """``1 / sqrt(mean(x^2) + eps)`` over the last axis of float32 ``x`` [..., L]: [..., 1]."""
    return lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def allreduce_norm_latent_out(
    routed_partial: jax.Array,
    norm_weight: jax.Array | None,
    *,
    config: TailConfig,
    axis_name: AxisName,
    platform: str | None = None,
) -> jax.Array:
    """``RMSNorm_g(c * psum(r))`` for this rank: the fully reduced, normalised latent.

    Runs inside ``jax.shard_map``. routed_partial: this rank's [T, L] partial (``config.dtype``),
    or the already reduced latent when ``config.fused_output_is_reduced`` (then no collective).
    norm_weight: [L], ignored when ``config.use_latent_norm`` is False.
    Returns [T, L] in ``config.dtype``, identical on every rank.
    ``platform`` (a device's ``.platform``; None: not known), ``config.all_reduce_form`` and
    ``config.all_reduce_quantization`` decide the all-reduce's form (:mod:`k3_tail.tiers.collectives`).
    Cost per rank: one all-reduce of T*L elements in ``config.dtype`` (2(p-1)/p * 2TL bytes on a
    ring for bf16) and O(TL) elementwise work. The norm must see the fully reduced latent: it is
    nonlinear per row, so it cannot be applied to partials.

    vLLM fuses the all-reduce and the norm into one AITER kernel on ROCm; XLA fuses the norm's
    elementwise work into the consumer of the all-reduce on its own, so this is the plain form.
    """
    if config.fused_output_is_reduced:
        latent = routed_partial
    else:
        with jax.named_scope(LATENT_REDUCTION):
            latent = all_reduce(routed_partial, axis_name=axis_name, config=config, platform=platform)
    weight = norm_weight if config.use_latent_norm else None
    normed = rms_norm(latent, weight, eps=config.rms_norm_eps, scale=config.routed_scaling_factor)
    return normed.astype(config.dtype)
