"""The tail's building blocks one at a time, for experiments that time or check one alone.

Each is what the tiers run (:mod:`k3_tail.ops`, which stays internal), behind a signature that takes
a :class:`~k3_tail.TailConfig` and plain arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail.config import TailConfig
from k3_tail.hardware import device_platform
from k3_tail.ops import collectives, fused_launch, fused_projection, norm, up_projection
from k3_tail.ops.codecs import CODECS
from k3_tail.ops.columns import WEIGHT_LAYOUTS
from k3_tail.ops.up_projection import FP8_FORMATS

# The weight layouts ("column", "replicated"), the up projection's FP8 formats and the all-reduce codecs
# ("int8", "int6", "int4").
__all__ = ["CODEC_NAMES", "FP8_FORMATS", "WEIGHT_LAYOUTS", "all_reduce", "gemm_rows", "norm_project_add", "project",
           "rms_norm"]
CODEC_NAMES = tuple(CODECS)


def project(latent: jax.Array, kernel: jax.Array) -> jax.Array:
    """``latent @ kernel`` [T, L] x [L, N] -> float32 [T, N] as the tiers' up projection computes it
    (one row multiplied as two: :func:`gemm_rows`)."""
    return up_projection.project(latent, kernel)


def gemm_rows(rows: int) -> int:
    """The rows the up projection's GEMM multiplies for ``rows`` latent rows: 2 for one, else ``rows``."""
    return up_projection.gemm_rows(rows)


def rms_norm(x: jax.Array, weight: jax.Array | None, config: TailConfig) -> jax.Array:
    """The tail's RMSNorm of ``c * x`` [T, L] in float32, with ``config``'s eps and scale c."""
    return norm.rms_norm(x, weight, eps=config.rms_norm_eps, scale=config.routed_scaling_factor)


def norm_project_add(latent: jax.Array, weight: jax.Array | None, kernel: jax.Array, addend: jax.Array,
                     config: TailConfig) -> jax.Array:
    """one_kernel's local work in its one Pallas kernel: ``round(RMSNorm(c * latent) @ kernel + addend)``,
    [T, L] x [L, N] + [T, N] -> [T, N] in ``config.dtype``; interpreted on a CPU, compiled on a GPU, as the tier."""
    platform = device_platform(jax.devices()[0])
    return fused_projection.norm_project_add(
        latent, weight, kernel, addend, rank=jnp.zeros((1,), jnp.int32),
        projection=fused_projection.BlockProjection(tp_size=1, hidden_size=kernel.shape[1], eps=config.rms_norm_eps,
                                                    scale=config.routed_scaling_factor),
        interpret=fused_launch.runs_interpreted_on(platform), platform=platform)


def all_reduce(x: jax.Array, config: TailConfig, *, axis_name: str, platform: str | None = None) -> jax.Array:
    """Inside ``jax.shard_map``: the tail's sum of ``x`` [T, W] over ``axis_name`` on every rank, in the
    form ``config`` gives it (quantised two-shot, one all-reduce, or reduce-scatter + all-gather)."""
    sums = config.sum_plan(lax.axis_size(axis_name), platform)
    return collectives.all_reduce(x, axis_name=axis_name, sums=sums)
