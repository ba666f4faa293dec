"""Block quantisation of a collective's payload: vLLM ROCm QuickReduce's INT8, INT6 and INT4 codecs.

A block of ``BLOCK`` = 32 values travels as 32 b-bit integers and one bfloat16 scale (computed in float32):

    scale = bfloat16(-m / 2^(b-1)),   m = max |x| over the block (an all-zero block: -0)
    q     = clamp(round(x / scale), -2^(b-1), 2^(b-1) - 1)        (round half to even)
    x'    = q * scale

The negative scale is QuickReduce's: the largest positive value lands on -2^(b-1), the level without a twin.
Non-finite values decode to NaN at their own elements only (a scale over a NaN would spread or hide it): such a
block's scale has its sign bit clear, +m / (2^(b-1) - 1) over the finite values, and the spare level -2^(b-1)
marks each non-finite element. Error per value: |scale| / 2 where no clamp applies, ``max_error(m)`` for any
finite value; a subnormal scale (m < 2^(b-1) * 1.2e-38) may decode to zeros (XLA flushes subnormals).
Wire format of a block: the values in offset binary (q + 2^(b-1)), ``group`` of them little-endian in
``group * b / 8`` bytes, then the scale's two bytes.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 32
_SCALE_BYTES = 2  # bfloat16
_SIGN_BIT = 0x8000  # of the bfloat16 scale: clear in a block that holds a non-finite value


@dataclasses.dataclass(frozen=True)
class Codec:
    """One block codec: ``name`` ("int8"), ``bits`` per value, ``group`` values packed in whole bytes."""

    name: str
    bits: int
    group: int

    @property
    def lowest(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def highest(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def relative_step(self) -> float:
        """The step between two levels relative to the block's largest magnitude, 1 / 2^(b-1)."""
        return 1.0 / -self.lowest

    @property
    def block_bytes(self) -> int:
        return BLOCK * self.bits // 8 + _SCALE_BYTES

    def encoded_bytes(self, elements: int) -> int:
        """Bytes of ``elements`` values encoded (the last block padded with zeros)."""
        return -(-elements // BLOCK) * self.block_bytes

    def max_error(self, block_max: float) -> float:
        """The largest error one encode-decode puts on a value of a block of largest magnitude ``block_max``."""
        if block_max * self.relative_step < float(jnp.finfo(jnp.float32).tiny):  # a subnormal scale
            return block_max
        step = block_max * self.relative_step * (1 + 2**-8)
        return step * (1 + 2.0 ** (self.bits - 9) / (1 - 2**-8))

    def encode(self, blocks: jax.Array) -> jax.Array:
        """``blocks`` [..., BLOCK] (float32) as uint8 [..., block_bytes]: packed values, then the scale."""
        finite = jnp.isfinite(blocks)
        marked = ~jnp.all(finite, axis=-1, keepdims=True)  # the block holds a NaN or an infinity
        magnitude = jnp.max(jnp.where(finite, jnp.abs(blocks), 0.0), axis=-1, keepdims=True)
        steps = jnp.where(marked, float(self.highest), float(-self.lowest))
        # |scale| in bfloat16, its sign bit set for an ordinary block (-m / 2^(b-1), -0 when all zero)
        # and clear for a marked one: set from the bits, so no rounding or flushing can change the mark.
        size_bits = lax.bitcast_convert_type((magnitude / steps).astype(jnp.bfloat16), jnp.uint16)
        scale_bits = jnp.where(marked, size_bits, size_bits | _SIGN_BIT)
        scale = lax.bitcast_convert_type(scale_bits, jnp.bfloat16).astype(jnp.float32)
        inverse = jnp.where(scale == 0, 0.0, 1.0 / jnp.where(scale == 0, 1.0, scale))
        lowest = jnp.where(marked, self.lowest + 1, self.lowest)
        levels = jnp.clip(jnp.round(jnp.where(finite, blocks, 0.0) * inverse), lowest, self.highest)
        levels = jnp.where(finite, levels, self.lowest)  # the spare level of a marked block: NaN
        offset = (levels - self.lowest).astype(jnp.uint32)
        grouped = offset.reshape(*offset.shape[:-1], BLOCK // self.group, self.group)
        # The group's values side by side in one little-endian word (disjoint bits: their sum is their OR).
        words = jnp.sum(grouped << self._shifts, axis=-1, dtype=jnp.uint32)
        packed = lax.bitcast_convert_type(words, jnp.uint8)[..., : self._group_bytes]
        values = packed.reshape(*offset.shape[:-1], BLOCK * self.bits // 8)
        return jnp.concatenate([values, lax.bitcast_convert_type(scale_bits[..., 0], jnp.uint8)], axis=-1)

    def decode(self, encoded: jax.Array) -> jax.Array:
        """``encoded`` uint8 [..., block_bytes] back to float32 values [..., BLOCK]."""
        leading = encoded.shape[:-1]
        value_bytes = BLOCK * self.bits // 8
        scale_bits = lax.bitcast_convert_type(encoded[..., value_bytes:], jnp.uint16)
        marked = (scale_bits & _SIGN_BIT) == 0
        scale = lax.bitcast_convert_type(scale_bits, jnp.bfloat16).astype(jnp.float32)
        packed = encoded[..., :value_bytes].reshape(*leading, BLOCK // self.group, self._group_bytes)
        padding = [(0, 0)] * len(leading) + [(0, 0), (0, 4 - self._group_bytes)]
        words = lax.bitcast_convert_type(jnp.pad(packed, padding), jnp.uint32)
        offset = (words[..., None] >> self._shifts) & ((1 << self.bits) - 1)
        levels = offset.reshape(*leading, BLOCK).astype(jnp.int32) + self.lowest
        limit = float(jnp.finfo(jnp.float32).max)
        values = jnp.clip(levels.astype(jnp.float32) * scale[..., None], -limit, limit)
        return jnp.where(marked[..., None] & (levels == self.lowest), jnp.nan, values)

    @property
    def _group_bytes(self) -> int:
        return self.group * self.bits // 8

    @property
    def _shifts(self) -> jax.Array:
        return jnp.arange(self.group, dtype=jnp.uint32) * self.bits


CODECS = MappingProxyType({
    "int8": Codec("int8", bits=8, group=1),
    "int6": Codec("int6", bits=6, group=4),
    "int4": Codec("int4", bits=4, group=2),
})
