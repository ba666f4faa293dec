"""MXFP4 as compressed-tensors stores it (``mxfp4-pack-quantized``, Kimi-K3's routed experts): the format's facts,
its bytes, the loader's checks and the exact decode.

For each torch Linear weight [out, in] the checkpoint holds (:func:`stored_tensors`)

    weight_packed  uint8 [out, in / 2]    two E2M1 codes per byte: the LOW nibble is the even input column
    weight_scale   uint8 [out, in / 32]   one E8M0 exponent u per 32 input columns: the scale 2^(u - 127)

An E2M1 code s e e m is 0, 0.5, 1, 1.5, 2, 3, 4, 6 by e e m, negative when s is set (code 8 is -0); a weight is
its code's value times its group's scale, 0.53125 bytes a weight (:data:`MXFP4_BYTES`). u = 255 is NaN, as the OCP
MX specification defines it (compressed-tensors' ``decompress`` computes inf there). :func:`decode` is exact to
bfloat16 and float32 on every backend, subnormals included; a value past the dtype's largest finite is +-inf, and
the checkpoint loader refuses such groups (:func:`overflowing_groups`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3_tail._checks import describe

# compressed-tensors' name of the format, in config.json's quantization_config, and of a Linear's two tensors.
QUANT_METHOD, FORMAT = "compressed-tensors", "mxfp4-pack-quantized"
PACKED, SCALE = "weight_packed", "weight_scale"
STORED_DTYPE = np.dtype(np.uint8)
# Bits of one E2M1 code, the codes one byte holds, and the input columns under one E8M0 scale.
CODE_BITS, CODES_PER_BYTE, GROUP_SIZE = 4, 2, 32
SCALE_BIAS, NAN_SCALE = 127, 255
# Bytes held per weight, packed: half a byte of code and a 32nd of a byte of scale (4.25 bits).
MXFP4_BYTES = 1 / CODES_PER_BYTE + 1 / GROUP_SIZE
# The E2M1 magnitudes by their 3 low bits (e e m).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# The dtypes decode writes: their 8 exponent bits hold every MXFP4 value exactly (float16's 5 do not).
DECODED_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32))
_MANTISSA_BITS = {np.dtype(jnp.bfloat16): 7, np.dtype(np.float32): 23}
_BITS_DTYPES = {np.dtype(jnp.bfloat16): jnp.uint16, np.dtype(np.float32): jnp.uint32}
_EXPONENT_FIELD_MAX = 255  # all ones: inf and NaN
# The scales (2^126, 2^127) under which a large code passes the decoded dtypes' largest finite (255 is NaN).
OVERFLOWING_SCALES = (253, 254)


def stored_tensors(out_features: int, in_features: int) -> dict[str, tuple[tuple[int, int], str]]:
    """The tensors compressed-tensors stores for one Linear weight [out, in] (``in`` a multiple of 32): their
    names after the Linear's prefix -> (shape, what they hold), both of :data:`STORED_DTYPE` (uint8)."""
    return {PACKED: ((out_features, in_features // CODES_PER_BYTE), "two E2M1 codes per byte"),
            SCALE: ((out_features, in_features // GROUP_SIZE), f"one E8M0 scale per {GROUP_SIZE} input columns")}


def decode(packed: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The values [..., K, N] of MXFP4 codes ``packed`` uint8 [..., K/2, N] (low nibble the even row of K) with
    E8M0 exponents ``scale`` uint8 [..., K/32, N], in ``dtype`` (bfloat16 or float32), exactly: u = 255 gives NaN,
    a value past the dtype's largest finite +-inf. Elementwise after the unpacking: XLA fuses it into its consumer.

    Raises:
      ValueError: naming the argument, for another dtype, non-uint8 arguments, or shapes that do not pair.
    """
    dtype = decoded_dtype(dtype)
    check_packed(packed, scale)
    *leading, half, columns = packed.shape
    groups = half * CODES_PER_BYTE // GROUP_SIZE
    # Each byte bitcast to its two float4_e2m1fn codes, the low nibble first. Split by shifts instead (as
    # decode_by_group does), XLA's GPU layout assignment copied every expert's codes transposed (K-minor).
    values = jnp.swapaxes(jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn), -1, -2)  # [..., K/2, 2, N]
    values = values.reshape(*leading, groups, GROUP_SIZE // CODES_PER_BYTE, CODES_PER_BYTE, columns)
    return _scaled(values, scale, dtype).reshape(*leading, groups * GROUP_SIZE, columns)


def decoded_dtype(dtype: Any) -> np.dtype:
    """``dtype`` (or its name) as one of :data:`DECODED_DTYPES`; ValueError naming ``dtype`` otherwise (None too)."""
    try:
        value = None if dtype is None else np.dtype(dtype)
    except (TypeError, ValueError):
        value = None
    if value not in DECODED_DTYPES:
        got = value.name if value is not None else repr(dtype)
        raise ValueError(f"dtype: MXFP4 decodes to one of {tuple(d.name for d in DECODED_DTYPES)}, got {got}")
    return value


def check_packed(packed: Any, scale: Any) -> None:
    """ValueError naming the argument unless ``packed`` and ``scale`` are uint8 arrays that pair as codes
    [..., K/2, N] and scales [..., K/32, N], K a multiple of 32."""
    for name, value in (("packed", packed), ("scale", scale)):
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise ValueError(f"{name}: expected a uint8 array of at least 2 axes, got {describe(value)}")
        if np.dtype(value.dtype) != STORED_DTYPE or len(value.shape) < 2:
            raise ValueError(f"{name}: expected a uint8 array of at least 2 axes, got {value.dtype} {value.shape}")
    *leading, half, columns = packed.shape
    if half % (GROUP_SIZE // CODES_PER_BYTE):
        raise ValueError(f"packed: expected K/2 byte rows on its next-to-last axis, a multiple of "
                         f"{GROUP_SIZE // CODES_PER_BYTE} (the {GROUP_SIZE} codes under one scale), got shape "
                         f"{tuple(packed.shape)}")
    groups = half * CODES_PER_BYTE // GROUP_SIZE
    if tuple(scale.shape) != (*leading, groups, columns):
        raise ValueError(f"scale: expected shape {(*leading, groups, columns)} (one per {GROUP_SIZE} rows of packed "
                         f"{tuple(packed.shape)}, {GROUP_SIZE // CODES_PER_BYTE} bytes each), got {tuple(scale.shape)}")


def decode_by_group(packed: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """:func:`decode`'s values as [..., K/32, 16, 2, N], row 16 g + 2 j + h of K at [g, j, h] (h = 0 the low
    nibble); arguments as :func:`decode`, unchecked. A product reduced over (g, j, h) adds in K's order, and XLA
    fuses a gather of the kernels into it (merged into K first, XLA copied the gathered codes transposed)."""
    dtype = np.dtype(dtype)
    *leading, half, columns = packed.shape
    groups = half * CODES_PER_BYTE // GROUP_SIZE
    # The low nibble is row 2j, the high one row 2j + 1, by a broadcast shift, which XLA fuses into the consumer (a
    # stack, or decode's bitcast and a transpose, it writes out of gathered blocks). The reshape splits only minor,
    # unsharded axes, so a global array sharded along K decodes too.
    grouped = packed.reshape(*leading, groups, GROUP_SIZE // CODES_PER_BYTE, 1, columns)
    codes = (grouped >> jnp.array([0, CODE_BITS], jnp.uint8)[:, None]) & 0xF
    return _scaled(jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn), scale, dtype)


def _scaled(values: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    """``values`` float4_e2m1fn [..., K/32, 16, 2, N] times their scales (uint8 [..., K/32, N]), in ``dtype``."""
    scales = scale[..., None, None, :]

    def by_dtypes(values, scales):
        return values_by_dtypes(values, scales).astype(dtype)

    def from_bits(values, scales):
        codes = jax.lax.bitcast_convert_type(values, jnp.uint4)
        bits = value_bits(codes, scales, _MANTISSA_BITS[dtype]).astype(_BITS_DTYPES[dtype])
        return jax.lax.bitcast_convert_type(bits, dtype)

    # XLA:CPU flushes subnormal operands and results to zero (every value under u = 0, +-0.5 under u = 1), so a CPU
    # program builds the bits; chosen as the program is lowered, a GPU program holds the dtypes' product only.
    return jax.lax.platform_dependent(values, scales, cpu=from_bits, default=by_dtypes)


def values_by_dtypes(values: jax.Array, scales: jax.Array) -> jax.Array:
    """E2M1 ``values`` times 2^(u - 127) for E8M0 ``scales`` u (uint8), broadcast, in float32: exact where float
    arithmetic keeps subnormals (not on XLA:CPU)."""
    return values.astype(jnp.float32) * jax.lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu).astype(jnp.float32)


def value_bits(codes: jax.Array, scales: jax.Array, mantissa_bits: int) -> jax.Array:
    """The bits (uint32, low 1 + 8 + n bits) of code * 2^(u - 127) in a float format of 8 exponent bits and
    n = ``mantissa_bits`` (7: bfloat16, 23: float32), for E2M1 ``codes`` and E8M0 ``scales`` (integers, broadcast):
    :func:`decode`'s values, built with integer operations alone so that nothing flushes a subnormal."""
    n = mantissa_bits
    c, u = codes.astype(jnp.int32), scales.astype(jnp.int32)
    e, m = (c >> 1) & 3, c & 1
    # A code of e >= 1 is (1 + m/2) 2^(e - 1): times 2^(u - 127) the biased exponent e + u - 1, mantissa m/2. The
    # one of e = 0, m = 1 is 2^-1: the biased exponent u - 1, mantissa 0. (e = m = 0 is zero.)
    exponent = jnp.where(e > 0, e + u - 1, u - 1)
    normal = (exponent << n) | jnp.where(e > 0, m << (n - 1), 0)
    # Below the normal range (e = 0, or e = 1 with u = 0: only u <= 1 gets there) the value is an integer multiple
    # of the smallest subnormal 2^(-126 - n): 2|code| 2^(u + n - 2) of them (2|code| = m, or 2 + m), and those bits
    # are that integer.
    subnormal = (m + 2 * jnp.minimum(e, 1)) << jnp.maximum(u + n - 2, 0)
    finite = jnp.where((exponent > 0) & ((e > 0) | (m > 0)), normal, subnormal)
    all_ones = _EXPONENT_FIELD_MAX << n
    magnitude = jnp.where(u == NAN_SCALE, all_ones | (1 << (n - 1)), jnp.where(exponent >= _EXPONENT_FIELD_MAX,
                                                                               all_ones, finite))
    # The NaN of u = 255 is the positive quiet NaN whatever the code's sign, as the dtypes' product gives it.
    sign = jnp.where(u == NAN_SCALE, 0, c >> 3)
    return ((sign << (n + 8)) | magnitude).astype(jnp.uint32)


def overflowing_groups(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Which groups hold a value past float32's and bfloat16's largest finite, on the host: bool of ``scale``'s
    shape [..., K/32, N] for ``packed`` [..., K/2, N]; ValueError naming the argument for arrays that do not pair.
    The codes are read only under :data:`OVERFLOWING_SCALES` (biased exponent e + u - 1 past 254 when e + u >= 256)."""
    check_packed(packed, scale)
    packed, scale = np.asarray(packed), np.asarray(scale)
    suspect = np.isin(scale, OVERFLOWING_SCALES)
    if not suspect.any():
        return suspect
    exponent_bits = np.maximum((packed >> 1) & 3, (packed >> 5) & 3)  # of the low and the high code
    *leading, half, columns = packed.shape
    group_max = exponent_bits.reshape(*leading, half * CODES_PER_BYTE // GROUP_SIZE, GROUP_SIZE // CODES_PER_BYTE,
                                      columns).max(axis=-2)
    return suspect & (group_max.astype(np.int32) + scale >= _EXPONENT_FIELD_MAX + 1)
