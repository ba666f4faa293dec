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
"""

from __future__ import annotations

from types import MappingProxyType

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName

ALL_REDUCE = "all-reduce"
SPLIT = "reduce-scatter+all-gather"
ALL_REDUCE_FORMS = ("auto", ALL_REDUCE, SPLIT)
# The smallest buffer (bytes) from which "auto" splits an all-reduce, per (device platform, dtype
# name); others keep one all-reduce. CPU bfloat16: 8 forced CPU devices, jax 0.10.2: ratio
# RS+AG / AR 1.0 up to 7 MiB, 0.40-0.48 at 8.75-14 MiB, 0.75-0.86 at 28-70 MiB (docs/performance.md).
SPLIT_FROM_BYTES = MappingProxyType({("cpu", "bfloat16"): 8 * 2**20})


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


def all_reduce(x: jax.Array, *, axis_name: AxisName, all_reduce_form: str, platform: str | None) -> jax.Array:
    """The sum of ``x`` [T, W] over the ranks, on every rank, in :func:`resolved_form`'s form.

    The decomposition scatters rows: T is padded with zero rows to a multiple of p for it and the
    padding sliced off after the all-gather.
    """
    if resolved_form(all_reduce_form, platform, x.dtype, x.size * x.dtype.itemsize) == ALL_REDUCE:
        return lax.psum(x, axis_name)
    tp_size = lax.axis_size(axis_name)
    padding = -x.shape[0] % tp_size
    padded = jnp.pad(x, [(0, padding), (0, 0)]) if padding else x
    own = lax.psum_scatter(padded, axis_name, scatter_dimension=0, tiled=True)
    return lax.all_gather(own, axis_name, axis=0, tiled=True, to="invarying")[: x.shape[0]]
