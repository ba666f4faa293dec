"""float32 and FP8 values from their bits, for the fused kernel: exact powers of two, FP8 where Triton can't cast."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# float32 exponents: a power of two 2^e is the bit pattern (e + 127) << 23, normal for e in [-126, 127].
_EXPONENT_BIAS = 127
_MANTISSA_BITS = 23
_LARGEST_SLAB_EXPONENT = 126


# FP8 formats by name: (exponent bias, whether the all-ones code is NaN (OCP's E4M3FN) or 0x80 is (FNUZ)).
_FP8_CODES = {"float8_e4m3fn": (7, True), "float8_e4m3fnuz": (8, False)}


def decode_fp8(codes: jax.Array, fp8_format: str) -> jax.Array:
    """The exact float32 values of E4M3 bytes ``codes`` (uint8) in ``fp8_format`` ("float8_e4m3fn" or
    "float8_e4m3fnuz"), subnormals, signed zeros and NaN as the format has them."""
    bias, all_ones_is_nan = _FP8_CODES[fp8_format]
    bits = codes.astype(jnp.int32)
    negative = (bits & 0x80) != 0
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = lax.bitcast_convert_type(((exponent - bias + _EXPONENT_BIAS) << _MANTISSA_BITS) | (mantissa << 20),
                                      jnp.float32)
    magnitude = jnp.where(exponent > 0, normal, mantissa.astype(jnp.float32) * 2.0 ** (-2 - bias))
    nan = (exponent == 0xF) & (mantissa == 0x7) if all_ones_is_nan else bits == 0x80
    return jnp.where(nan, jnp.nan, jnp.where(negative, -magnitude, magnitude))


def exponent_at_or_above(x: jax.Array, floor_exponent: int) -> jax.Array:
    """int32 e with 2^e >= x (x >= 0 float32), clipped to [floor_exponent, 126]; NaN and infinity give 126."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    biased = lax.shift_right_logical(bits, jnp.int32(_MANTISSA_BITS))
    exponent = biased - _EXPONENT_BIAS + jnp.where((bits & ((1 << _MANTISSA_BITS) - 1)) != 0, 1, 0)
    return jnp.clip(exponent, floor_exponent, _LARGEST_SLAB_EXPONENT)


def power_of_two(exponent: jax.Array) -> jax.Array:
    """float32 2^exponent for int32 exponents in [-126, 127]; 0 below."""
    biased = jnp.clip(exponent + _EXPONENT_BIAS, 0, 2 * _EXPONENT_BIAS)
    return lax.bitcast_convert_type(lax.shift_left(biased, jnp.int32(_MANTISSA_BITS)), jnp.float32)
