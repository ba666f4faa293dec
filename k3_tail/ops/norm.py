"""The latent RMSNorm in float32 for any finite input, each row scaled by its largest magnitude (the plain formula
overflows from |x| of about 3e17): docs/design.md, "Extreme values". NaN and infinity propagate."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def rms_norm(x: jax.Array, weight: jax.Array | None, *, eps: float, scale: float = 1.0) -> jax.Array:
    """``RMSNorm_weight(scale * x)`` over the last axis of x [..., L] (any float dtype), as float32; ``weight`` [L],
    or None for ``scale * x`` alone. With a norm ``scale`` never multiplies x (scale * x may overflow)."""
    x = x.astype(jnp.float32)
    if weight is None:
        return x * scale
    if scale == 0:
        return x * 0.0  # keeps NaN and turns infinity into NaN, as 0 * x does
    # s = clip(max |x|, floor, 2^126), v = x / s, RMSNorm = sign(scale) * v * rsqrt(mean(v^2) + eps') * weight,
    # eps' = eps / (scale floor)^2: exact below the floor, below float32's resolution above it. s and each
    # reduction's result have one use, so XLA's GPU backend fuses both reductions in one kernel (a softmax's).
    floor = row_scale_floor(eps, scale, x.shape[-1])
    # Capped at 2^126 too: XLA divides by multiplying with the reciprocal, which float32 must hold.
    row_scale = jnp.clip(jnp.max(jnp.abs(x), axis=-1, keepdims=True), floor, _LARGEST_ROW_SCALE)
    normalised = x / row_scale
    inverse = lax.rsqrt(jnp.mean(jnp.square(normalised), axis=-1, keepdims=True) + eps / (scale * floor) ** 2)
    sign = 1.0 if scale > 0 else -1.0
    return normalised * (sign * inverse) * weight.astype(jnp.float32)


def inverse_rms(x: jax.Array, *, eps: float, scale: float = 1.0) -> jax.Array:
    """``scale / sqrt(mean((scale * x)^2) + eps)`` over the last axis of float32 ``x`` [..., L]: [..., 1], for any
    finite x (NaN or infinity: NaN)."""
    if scale == 0:
        return jnp.zeros(x.shape[:-1] + (1,), jnp.float32) * jnp.sum(x, axis=-1, keepdims=True)  # NaN stays
    # One pass gives m = max |x| and q = sum (x / m)^2 (as BLAS's nrm2); then, with r = sqrt(eps) / |scale|,
    #   m >= r: sign(scale) / m * rsqrt(q / L + (r / m)^2),   m < r: sign(scale) / r * rsqrt(1 + (m / r)^2 q / L).
    magnitude, scaled_squares = _max_and_scaled_sum_of_squares(x)
    mean = scaled_squares[..., None] / x.shape[-1]
    magnitude = magnitude[..., None]
    root_eps = math.sqrt(eps) / abs(scale)
    large = magnitude >= root_eps
    ratio = jnp.where(large, root_eps / jnp.where(large, magnitude, 1.0), magnitude / root_eps)
    inner = jnp.where(large, mean + jnp.square(ratio), 1.0 + jnp.square(ratio) * mean)
    # Divided last: 1 / m alone is subnormal (and flushed to zero on CPUs and GPUs) for m > 2^126, a row of
    # bf16's largest values, whose factor sqrt(L) / m is still normal.
    sign = 1.0 if scale > 0 else -1.0
    return sign * lax.rsqrt(inner) / jnp.where(large, magnitude, root_eps)


@jax.custom_jvp
def _max_and_scaled_sum_of_squares(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(m, q) over the last axis of float32 ``x``: m = max |x|, q = sum (x / m)^2 (0 for a zero row), in one pass.
    Differentiated as two passes: JAX differentiates no reduction with a combiner of its own."""
    magnitude = jnp.abs(x)

    def combine(left, right):
        (m_left, q_left), (m_right, q_right) = left, right
        m = jnp.maximum(m_left, m_right)
        divisor = jnp.where(m > 0, m, 1.0)
        return m, q_left * jnp.square(m_left / divisor) + q_right * jnp.square(m_right / divisor)

    ones = jnp.where(magnitude > 0, 1.0, 0.0)
    return lax.reduce((magnitude, ones), (jnp.float32(0), jnp.float32(0)), combine, (x.ndim - 1,))


@_max_and_scaled_sum_of_squares.defjvp
def _max_and_scaled_sum_of_squares_derivative(primals, tangents):
    def two_passes(x):
        magnitude = jnp.max(jnp.abs(x), axis=-1)
        divisor = jnp.where(magnitude > 0, magnitude, 1.0)[..., None]
        return magnitude, jnp.sum(jnp.square(x / divisor), axis=-1)

    _, derivative = jax.jvp(two_passes, primals, tangents)
    return _max_and_scaled_sum_of_squares(*primals), derivative


_LARGEST_ROW_SCALE = 2.0**126
_SMALLEST_NORMAL = 2.0**-126


def norm_is_computable(eps: float, scale: float, width: int) -> bool:
    """Whether float32 computes the norm of rows of ``width`` values with ``eps`` and a nonzero ``scale``:
    eps / scale^2 from 2^-252 to about 2^228 / width."""
    root_eps = math.sqrt(eps) / abs(scale)
    return _SMALLEST_NORMAL <= root_eps <= 2.0**127 and row_scale_floor(eps, scale, width) is not None


def row_scale_floor(eps: float, scale: float, width: int) -> float | None:
    """:func:`rms_norm`'s floor of the row scale: the power of two at or above 2^12 sqrt(width eps) / |scale|,
    at least float32's smallest normal; None where it or eps / (scale floor)^2 leaves float32's normals."""
    relative_eps = eps / (scale * scale)
    exponent = max(math.ceil(0.5 * math.log2(width * relative_eps)) + 12, -126)
    if exponent > 126 or relative_eps * 4.0**-exponent < _SMALLEST_NORMAL:
        return None
    return 2.0**exponent
