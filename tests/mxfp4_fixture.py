"""MXFP4 for the tests, in numpy and independent of k3_tail/models/kimi_k3/mxfp4.py: an encoder for fixtures and a
reference decoder.

Both work on tensors as compressed-tensors stores them, a torch Linear weight [out, in] as
``weight_packed`` uint8 [out, in/2] (two E2M1 codes per byte, the low nibble the even input column) and
``weight_scale`` uint8 [out, in/32] (one E8M0 exponent u per 32 input columns, the scale 2^(u - 127)).
The values are ml_dtypes' ``float4_e2m1fn``'s and ``float8_e8m0fnu``'s, computed in float64, where nothing
flushes: 2^-127 at u = 0, NaN at u = 255 (the OCP MX rule).
"""

import ml_dtypes
import numpy as np

GROUP_SIZE = 32
E2M1, E8M0 = ml_dtypes.finfo(ml_dtypes.float4_e2m1fn), ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu)


def encode(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(weight_packed, weight_scale) of ``weight`` [out, in] (in a multiple of 32), by the MX rule: per group of
    32 input columns the shared scale 2^(floor(log2(amax)) - 2) (2^-127 for an all-zero group), then each
    value over it rounded to the nearest E2M1 value (ties to even), clamped to +-6."""
    weight = np.asarray(weight, np.float64)
    out, columns = weight.shape
    groups = weight.reshape(out, columns // GROUP_SIZE, GROUP_SIZE)
    amax = np.abs(groups).max(axis=-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, E8M0.minexp)
    exponent = np.clip(exponent, E8M0.minexp, E8M0.maxexp - 1)  # 2^-127 .. 2^127
    scaled = np.clip(groups / 2.0 ** exponent[..., None], -float(E2M1.max), float(E2M1.max)).astype(np.float32)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(out, columns) & 0xF
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.astype(np.uint8), (2.0 ** exponent).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)


def decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float64 values [..., in] of ``packed`` [..., in/2] with ``scale`` [..., in/32] (:func:`values`)."""
    packed, scale = np.asarray(packed, np.uint8), np.asarray(scale, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return values(codes, np.repeat(scale, GROUP_SIZE, axis=-1))


def values(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """code * scale in float64 for E2M1 ``codes`` (uint8, one a byte) and E8M0 ``scales`` (uint8), broadcast: each
    read as ml_dtypes' float4_e2m1fn and float8_e8m0fnu (2^(u - 127), NaN where u = 255)."""
    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    return (codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
            * scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64))
