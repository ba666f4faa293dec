"""MXFP4 for the tests, in numpy and independent of examples/kimi_k3_mxfp4.py: an encoder for fixtures and a
reference decoder.

Both work on tensors as compressed-tensors stores them, a torch Linear weight [out, in] as
``weight_packed`` uint8 [out, in/2] (two E2M1 codes per byte, the low nibble the even input column) and
``weight_scale`` uint8 [out, in/32] (one E8M0 exponent u per 32 input columns, the scale 2^(u - 127)).
The codes' values are ml_dtypes' ``float4_e2m1fn``'s; u = 255 is NaN (the OCP MX rule).
"""

import ml_dtypes
import numpy as np

GROUP_SIZE = 32
E2M1_MAX = 6.0
SCALE_BIAS, NAN_SCALE = 127, 255


def encode(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(weight_packed, weight_scale) of ``weight`` [out, in] (in a multiple of 32), by the MX rule: per group of
    32 input columns the shared scale 2^(floor(log2(amax)) - 2) (2^-127 for an all-zero group), then each
    value over it rounded to the nearest E2M1 value (ties to even), clamped to +-6."""
    weight = np.asarray(weight, np.float64)
    out, columns = weight.shape
    groups = weight.reshape(out, columns // GROUP_SIZE, GROUP_SIZE)
    amax = np.abs(groups).max(axis=-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -SCALE_BIAS)
    exponent = np.clip(exponent, -SCALE_BIAS, NAN_SCALE - 1 - SCALE_BIAS)
    scaled = np.clip(groups / 2.0 ** exponent[..., None], -E2M1_MAX, E2M1_MAX).astype(np.float32)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(out, columns) & 0xF
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.astype(np.uint8), (exponent + SCALE_BIAS).astype(np.uint8)


def decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float64 values [..., in] of ``packed`` [..., in/2] with ``scale`` [..., in/32]: each nibble read as
    ml_dtypes' float4_e2m1fn, times 2.0 ** (u - 127), NaN where u = 255."""
    packed, scale = np.asarray(packed, np.uint8), np.asarray(scale, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scales = np.where(scale == NAN_SCALE, np.nan, 2.0 ** (scale.astype(np.float64) - SCALE_BIAS))
    return values * np.repeat(scales, GROUP_SIZE, axis=-1)
