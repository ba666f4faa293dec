"""How a sum over the TP ranks travels: one all-reduce, a reduce-scatter + all-gather, or quantised.

Quantised sums (vLLM ROCm's QuickReduce, :mod:`k3_tail.ops.codecs`; docs/design.md, "How sums travel") take two
shots: each rank encodes p chunks and sends chunk j to rank j (an all-to-all); rank j sums its p decoded chunks in
float32 and re-encodes the sum, which every rank gathers and decodes (an all-gather): the same bytes on every
rank, so the same result. Per rank 2(p-1)/p * B * (b/16 + 1/32) bytes for a bf16 buffer of B bytes; a
reduce-scatter sends the first shot alone.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName
from k3_tail.ops.codecs import BLOCK, Codec

ALL_REDUCE = "all-reduce"
SPLIT = "reduce-scatter+all-gather"
ALL_REDUCE_FORMS = ("auto", ALL_REDUCE, SPLIT)
# The smallest buffer (bytes) from which "auto" splits an all-reduce, per (device platform, dtype name):
# docs/measurements/2026-11-30-collective-forms.md. GPUs keep XLA's ring all-reduce (overlap rests on it).
SPLIT_FROM_BYTES = MappingProxyType({("cpu", "bfloat16"): 8 * 2**20})
# vLLM's QuickReduce minimum sizes in MiB per (dtype of the table, p), per codec; bfloat16 follows the float16
# rows unless quantized_all_reduce_fp16_sizes_for_bf16 is False; other p use the row of the largest p below.
QUICK_REDUCE_MIN_MIB = MappingProxyType({
    ("float16", 2): MappingProxyType({"int8": 2, "int6": 2, "int4": 1}),
    ("float16", 4): MappingProxyType({"int8": 16, "int6": 4, "int4": 2}),
    ("float16", 8): MappingProxyType({"int8": 4, "int6": 4, "int4": 2}),
    ("bfloat16", 2): MappingProxyType({"int8": 8, "int6": 8, "int4": 8}),
    ("bfloat16", 4): MappingProxyType({"int8": 64, "int6": 64, "int4": 16}),
    ("bfloat16", 8): MappingProxyType({"int8": 2048, "int6": 2048, "int4": 2048}),
})


def describe_auto(platform: str | None, dtype: jnp.dtype) -> str | None:
    """What "auto" does on ``platform`` for ``dtype``, in words, or None when it keeps one all-reduce."""
    threshold = SPLIT_FROM_BYTES.get((platform, jnp.dtype(dtype).name))
    if threshold is None:
        return None
    return (f"on {platform} a {jnp.dtype(dtype).name} all-reduce of >= {threshold / 2**20:g} MiB runs as "
            "reduce-scatter + all-gather (measured faster there)")


@dataclasses.dataclass(frozen=True)
class SumPlan:
    """How the sums of one call travel (``TailConfig.sum_plan``): the form, the platform (None: not known), the
    codec of quantised sums and the (smallest, largest) buffer in bytes that travels quantised."""

    form: str = "auto"
    platform: str | None = None
    codec: Codec | None = None
    quantized_bytes: tuple[int, int] = (1, 0)

    def codec_for(self, nbytes: int) -> Codec | None:
        """The codec a sum of an ``nbytes``-byte buffer travels in, or None."""
        smallest, largest = self.quantized_bytes
        return self.codec if self.codec is not None and smallest <= nbytes <= largest else None

    def form_for(self, dtype: jnp.dtype, nbytes: int) -> str:
        """The form ("all-reduce" or "reduce-scatter+all-gather") a sum of ``nbytes`` bytes of ``dtype`` takes."""
        if self.form != "auto":
            return self.form
        threshold = SPLIT_FROM_BYTES.get((self.platform, jnp.dtype(dtype).name))
        return SPLIT if threshold is not None and nbytes >= threshold else ALL_REDUCE


def all_reduce(x: jax.Array, *, axis_name: AxisName, sums: SumPlan) -> jax.Array:
    """The sum of ``x`` [T, W] over the ranks, on every rank, in ``x.dtype``, as ``sums`` says."""
    nbytes = x.size * x.dtype.itemsize
    codec = sums.codec_for(nbytes)
    if codec is not None:
        return _quantized_sum(x, codec, axis_name=axis_name, scatter_dimension=None)
    if sums.form_for(x.dtype, nbytes) == ALL_REDUCE:
        return lax.psum(x, axis_name)
    tp_size = lax.axis_size(axis_name)
    padding = -x.shape[0] % tp_size
    padded = jnp.pad(x, [(0, padding), (0, 0)]) if padding else x
    own = lax.psum_scatter(padded, axis_name, scatter_dimension=0, tiled=True)
    return lax.all_gather(own, axis_name, axis=0, tiled=True, to="invarying")[: x.shape[0]]


def reduce_scatter(x: jax.Array, *, axis_name: AxisName, sums: SumPlan, scatter_dimension: int) -> jax.Array:
    """This rank's block of the sum of ``x`` along ``scatter_dimension`` (p divides it), as ``sums`` says."""
    codec = sums.codec_for(x.size * x.dtype.itemsize)
    if codec is not None:
        return _quantized_sum(x, codec, axis_name=axis_name, scatter_dimension=scatter_dimension)
    return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=True)


def quantized_scope(codec: Codec) -> str:
    """The named scope on the collectives of a sum quantised with ``codec`` ("quantized_int4")."""
    return f"quantized_{codec.name}"


def _quantized_sum(x: jax.Array, codec: Codec, *, axis_name: AxisName, scatter_dimension: int | None) -> jax.Array:
    """The two-shot quantised sum of ``x``, or this rank's block along ``scatter_dimension``. Differentiating it
    is a ValueError, not the zero gradient that rounding would silently give."""

    @jax.custom_jvp
    def quantized_sum(x):
        return _two_shot_sum(x, codec, axis_name=axis_name, scatter_dimension=scatter_dimension)

    @quantized_sum.defjvp
    def _refuse(primals, tangents):
        raise ValueError(f"all_reduce_quantization={codec.name!r}: a quantised sum rounds its buffer to {codec.name} "
                         "codes, which have no derivative; differentiate the tail with "
                         "TailConfig(all_reduce_quantization=None)")

    return quantized_sum(x)


def _two_shot_sum(x: jax.Array, codec: Codec, *, axis_name: AxisName, scatter_dimension: int | None) -> jax.Array:
    tp_size = lax.axis_size(axis_name)
    if scatter_dimension is None:  # chunk k: the k-th 1/p of the flattened buffer
        chunks = jnp.pad(x.reshape(-1), (0, -x.size % tp_size)).reshape(tp_size, -1)
    else:  # chunk k: block k along the scatter dimension, which the caller keeps
        shape = x.shape
        split = x.reshape(*shape[:scatter_dimension], tp_size, shape[scatter_dimension] // tp_size,
                          *shape[scatter_dimension + 1:])
        chunks = jnp.moveaxis(split, scatter_dimension, 0).reshape(tp_size, -1)
    width = chunks.shape[1]
    blocks = jnp.pad(chunks.astype(jnp.float32), [(0, 0), (0, -width % BLOCK)]).reshape(tp_size, -1, BLOCK)
    with jax.named_scope(quantized_scope(codec)):
        received = lax.all_to_all(codec.encode(blocks), axis_name, 0, 0, tiled=True)
    # Clipped to float32's range: a finite sum that overflows stays finite through the second shot and
    # rounds to the dtype's infinity at the end, as the unquantised sum's; a NaN stays NaN (the clip keeps it).
    limit = float(jnp.finfo(jnp.float32).max)
    own = jnp.clip(jnp.sum(codec.decode(received), axis=0), -limit, limit)
    if scatter_dimension is not None:
        block_shape = list(x.shape)
        block_shape[scatter_dimension] //= tp_size
        return own.reshape(-1)[:width].reshape(block_shape).astype(x.dtype)
    with jax.named_scope(quantized_scope(codec)):
        gathered = lax.all_gather(codec.encode(own), axis_name, axis=0, to="invarying")
    total = codec.decode(gathered).reshape(tp_size, -1)[:, :width]
    return total.reshape(-1)[: x.size].reshape(x.shape).astype(x.dtype)
