"""How a sum over the TP ranks travels: one all-reduce, or a reduce-scatter followed by an all-gather.

Both forms leave the same [T, W] sum on every rank and move the same bytes on a ring
(2(p-1)/p * B), but backends implement them differently. GPU backends run XLA's all-reduce as one
NCCL/RCCL ring collective, and the tiers keep it there (the overlap tier's schedule rests on an
async all-reduce). XLA's CPU collectives are not a ring, and there the decomposition of a bfloat16
buffer is about twice as fast from about 8 MiB on, while below that the two tie and for float32 the
decomposition is never faster (measured with ``scripts/collective_forms.py``; docs/performance.md
has the numbers and the command), so the tiers use it where ``SPLIT_FROM_BYTES`` says.

``TailConfig.all_reduce_form`` chooses: "auto" (the measured rule above, per platform and buffer
size, decided at trace time), "all-reduce" (always one all-reduce: XLA's default) or
"reduce-scatter+all-gather" (always the decomposition). The compiled program shows which form ran
(:mod:`k3_tail.xla.report`), and :func:`k3_tail.select_tier` says so in its reason when given the
platform.

**Quantised sums** (vLLM ROCm's QuickReduce). With ``TailConfig.all_reduce_quantization`` a codec
of :mod:`k3_tail.ops.codecs`, a sum whose buffer holds between ``quantization_min_bytes`` and
``quantized_all_reduce_max_bytes`` bytes travels block-quantised in two shots: each rank cuts the
flattened buffer into p chunks, encodes them and sends chunk j to rank j (one all-to-all); rank j
decodes the p versions of its chunk and sums them in float32, re-encodes the sum and every rank
gathers all chunks (one all-gather) and decodes them. Both collectives move uint8 payload bytes,
(p-1)/p of the encoded buffer each: 2(p-1)/p * B * (b/16 + 1/32) bytes per rank for a bf16 buffer of
B bytes, against 2(p-1)/p * B unquantised, for two collective latencies instead of one and three
memory-bound codec passes. Every rank decodes the same gathered bytes, so the result is identical on
every rank. A sum that only scatters (a reduce-scatter) sends the first shot alone: its owner's
float32 chunk sum, rounded once to the dtype, is the result. A NaN or an infinity in any rank's
buffer arrives as NaN at its own elements of the sum, and nowhere else (:mod:`k3_tail.ops.codecs`):
non-finite exactly where the unquantised sum is, but for an infinity, which arrives as NaN, and the
rare finite sum that a codec step takes past the dtype's range. The decision is per buffer, at trace
time, like the form above; p = 1 sends nothing and quantises nothing. QuickReduce itself runs on 2,
4 or 8 ranks; this form runs on any p.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName
from k3_tail.ops.codecs import BLOCK, CODECS, Codec

# Functions below take a k3_tail.TailConfig as ``config`` (typed Any: the config module imports this one).

ALL_REDUCE = "all-reduce"
SPLIT = "reduce-scatter+all-gather"
ALL_REDUCE_FORMS = ("auto", ALL_REDUCE, SPLIT)
# The smallest buffer (bytes) from which "auto" splits an all-reduce, per (device platform, dtype
# name); others keep one all-reduce. CPU bfloat16: 8 forced CPU devices, jax 0.10.2: ratio
# RS+AG / AR 1.0 up to 7 MiB, 0.40-0.48 at 8.75-14 MiB, 0.75-0.86 at 28-70 MiB (docs/performance.md).
SPLIT_FROM_BYTES = MappingProxyType({("cpu", "bfloat16"): 8 * 2**20})
# vLLM's QuickReduce minimum sizes in MiB per (dtype the codec's table is for, p), per codec ("based on
# kernel tests" on MI300X, vLLM says); bfloat16 follows the float16 rows unless
# quantized_all_reduce_fp16_sizes_for_bf16 is False. Other p use the row of the largest p below.
QUICK_REDUCE_MIN_MIB = MappingProxyType({
    ("float16", 2): MappingProxyType({"int8": 2, "int6": 2, "int4": 1}),
    ("float16", 4): MappingProxyType({"int8": 16, "int6": 4, "int4": 2}),
    ("float16", 8): MappingProxyType({"int8": 4, "int6": 4, "int4": 2}),
    ("bfloat16", 2): MappingProxyType({"int8": 8, "int6": 8, "int4": 8}),
    ("bfloat16", 4): MappingProxyType({"int8": 64, "int6": 64, "int4": 16}),
    ("bfloat16", 8): MappingProxyType({"int8": 2048, "int6": 2048, "int4": 2048}),
})


def resolved_form(all_reduce_form: str, platform: str | None, dtype: jnp.dtype, nbytes: int) -> str:
    """The form a sum of ``nbytes`` bytes of ``dtype`` takes on ``platform`` (None: not known, one
    all-reduce) under ``all_reduce_form``: "all-reduce" or "reduce-scatter+all-gather"."""
    if all_reduce_form != "auto":
        return all_reduce_form
    threshold = SPLIT_FROM_BYTES.get((platform, jnp.dtype(dtype).name))
    return SPLIT if threshold is not None and nbytes >= threshold else ALL_REDUCE


def describe_auto(platform: str | None, dtype: jnp.dtype) -> str | None:
    """What "auto" does on ``platform`` for ``dtype``, in words, or None when it keeps one all-reduce."""
    threshold = SPLIT_FROM_BYTES.get((platform, jnp.dtype(dtype).name))
    if threshold is None:
        return None
    return (f"on {platform} a {jnp.dtype(dtype).name} all-reduce of >= {threshold / 2**20:g} MiB runs as "
            "reduce-scatter + all-gather (measured faster there)")


def quantization_min_bytes(config: Any, tp_size: int) -> int | None:
    """The smallest buffer (bytes) that ``config`` sends quantised over ``tp_size`` ranks, or None when
    it quantises nothing there: no codec, p = 1, or a dtype without a vLLM table (float32) and no
    ``quantized_all_reduce_min_bytes``."""
    if config.all_reduce_quantization is None or tp_size == 1:
        return None
    if config.quantized_all_reduce_min_bytes is not None:
        return config.quantized_all_reduce_min_bytes
    dtype = jnp.dtype(config.dtype).name
    if dtype == "bfloat16" and config.quantized_all_reduce_fp16_sizes_for_bf16:
        dtype = "float16"
    rows = [size for (name, size) in QUICK_REDUCE_MIN_MIB if name == dtype and size <= tp_size]
    if not rows:
        return None
    return QUICK_REDUCE_MIN_MIB[dtype, max(rows)][config.all_reduce_quantization] * 2**20


def quantization_window(config: Any, tp_size: int) -> tuple[Codec, int, int] | None:
    """(codec, smallest, largest buffer in bytes) of the sums ``config`` quantises over ``tp_size``
    ranks, or None when it quantises none (an empty buffer never is: nothing travels)."""
    minimum = quantization_min_bytes(config, tp_size)
    if minimum is None:
        return None
    return CODECS[config.all_reduce_quantization], max(minimum, 1), config.quantized_all_reduce_max_bytes


def quantized_codec(config: Any, nbytes: int, tp_size: int) -> Codec | None:
    """The codec a sum of an ``nbytes``-byte buffer over ``tp_size`` ranks travels in under ``config``,
    or None for the unquantised forms."""
    window = quantization_window(config, tp_size)
    if window is None or not window[1] <= nbytes <= window[2]:
        return None
    return window[0]


def describe_quantization(config: Any, tp_size: int) -> str | None:
    """Which sums ``config`` quantises over ``tp_size`` ranks, in words, or None when it has no codec."""
    codec = config.all_reduce_quantization
    if codec is None:
        return None
    minimum = quantization_min_bytes(config, tp_size)
    if minimum is None:
        why = "p = 1" if tp_size == 1 else f"vLLM has no minimum size for {jnp.dtype(config.dtype).name}"
        return f"all_reduce_quantization={codec!r} quantises nothing here ({why})"
    source = "" if config.quantized_all_reduce_min_bytes is not None else " (vLLM's minimum for the dtype and p)"
    return (f"{codec}-quantised two-shot sums for buffers of {_mib(minimum)}{source} to "
            f"{_mib(config.quantized_all_reduce_max_bytes)}")


def all_reduce(x: jax.Array, *, axis_name: AxisName, config: Any, platform: str | None) -> jax.Array:
    """The sum of ``x`` [T, W] over the ranks, on every rank, in ``x.dtype``: quantised when
    :func:`quantized_codec` gives a codec for it, else in :func:`resolved_form`'s form.

    The decomposition scatters rows: T is padded with zero rows to a multiple of p for it and the
    padding sliced off after the all-gather.
    """
    nbytes = x.size * x.dtype.itemsize
    codec = quantized_codec(config, nbytes, lax.axis_size(axis_name))
    if codec is not None:
        return _quantized_sum(x, codec, axis_name=axis_name, scatter_dimension=None)
    if resolved_form(config.all_reduce_form, platform, x.dtype, nbytes) == ALL_REDUCE:
        return lax.psum(x, axis_name)
    tp_size = lax.axis_size(axis_name)
    padding = -x.shape[0] % tp_size
    padded = jnp.pad(x, [(0, padding), (0, 0)]) if padding else x
    own = lax.psum_scatter(padded, axis_name, scatter_dimension=0, tiled=True)
    return lax.all_gather(own, axis_name, axis=0, tiled=True, to="invarying")[: x.shape[0]]


def reduce_scatter(x: jax.Array, *, axis_name: AxisName, config: Any, scatter_dimension: int) -> jax.Array:
    """This rank's block k of the sum of ``x`` over the ranks, along ``scatter_dimension`` (which p
    divides), in ``x.dtype``: one quantised shot when :func:`quantized_codec` gives a codec for the
    buffer, else a reduce-scatter."""
    codec = quantized_codec(config, x.size * x.dtype.itemsize, lax.axis_size(axis_name))
    if codec is not None:
        return _quantized_sum(x, codec, axis_name=axis_name, scatter_dimension=scatter_dimension)
    return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=True)


def quantized_scope(codec: Codec) -> str:
    """The named scope on the collectives of a sum quantised with ``codec`` ("quantized_int4")."""
    return f"quantized_{codec.name}"


def _quantized_sum(x: jax.Array, codec: Codec, *, axis_name: AxisName, scatter_dimension: int | None) -> jax.Array:
    """The two-shot quantised sum of ``x`` (module docstring): all of it when ``scatter_dimension`` is
    None, else this rank's block along that dimension (the first shot alone)."""
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


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB"
