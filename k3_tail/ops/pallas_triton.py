"""What k3_tail's Pallas Triton kernels share: the deprecation warning's filter, typing inside ``jax.shard_map``,
interpreted runs, products' precision. jax 0.12 warns at every lowering of a Triton ``pallas_call`` (failing
users whose warnings are errors), with no switch; a filter installed at import would sit below pytest's per-test
"error": so it is installed at trace time.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import varying_axes

# How jax's message starts (jax/_src/pallas/triton/pallas_call_registration.py, jax 0.12).
DEPRECATION_MESSAGE = "The Pallas Triton backend is deprecated"


def ignore_triton_deprecation_warning() -> None:
    """From now on, in the current warnings context, ignore jax's ``DeprecationWarning`` that the Pallas Triton
    backend is deprecated, and no other warning: one entry, first in ``warnings.filters``, never a second."""
    message = re.escape(DEPRECATION_MESSAGE)
    first = warnings.filters[0] if warnings.filters else None
    # Already first (every tail_forward on a GPU asks): leave the filters, and the caches a change clears, alone.
    if first is not None and first[0] == "ignore" and first[2] is DeprecationWarning and first[3] is None and (
            getattr(first[1], "pattern", None) == message):
        return
    warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)


def vary_alike(arrays: list) -> tuple[list, object]:
    """``arrays`` cast to vary over their union of mesh axes, and that manual-axis type for the outputs."""
    varying = [varying_axes(array) for array in arrays]
    axes = set().union(*varying)
    cast = [_vary_over(array, axes - own) if own != axes else array for array, own in zip(arrays, varying, strict=True)]
    aval = jax.typeof(cast[0])
    return cast, getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)


def interpreted(run: Callable[[list], jax.Array], arrays: list) -> jax.Array:
    """``run(arrays)`` for a ``pallas_call`` in interpret mode. Pallas's interpreter takes no value typed as varying
    over a ``jax.shard_map``'s axes (jax 0.10-0.12), so varying arrays are gathered and each device runs every
    device's call (``lax.map``), keeping its own result: p times the work, the same values."""
    varying = [varying_axes(array) for array in arrays]
    axes = set().union(*varying)
    if not axes:
        return run(arrays)
    names = tuple(sorted(axes, key=str))
    # Every varying array cast to vary over all the axes first: an all-gather over an axis takes only those.
    gathered = [lax.all_gather(_vary_over(array, axes - own), names, to="invarying") if own else None
                for array, own in zip(arrays, varying, strict=True)]

    def one_device(slices):
        slices = iter(slices)
        return run([array if stack is None else next(slices) for array, stack in zip(arrays, gathered, strict=True)])

    every = lax.map(one_device, [stack for stack in gathered if stack is not None])
    return lax.dynamic_index_in_dim(every, lax.axis_index(names), keepdims=False)


def _vary_over(array, missing: set):
    return lax.pcast(array, tuple(sorted(missing, key=str)), to="varying") if missing else array


def dot_precision(dtype) -> lax.Precision:
    """A kernel's ``jnp.dot`` precision for ``dtype``: HIGHEST for float32 (Triton would take TF32 on NVIDIA)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT
