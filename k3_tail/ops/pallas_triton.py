"""What k3_tail's Pallas Triton kernels share: the backend's deprecation warning kept out of the programs of
k3_tail's users, their outputs typed inside ``jax.shard_map``, their interpreted runs inside one that types its
values (:func:`interpreted`), their products' precision.

jax 0.12 warns at every lowering of a Triton ``pallas_call`` (a ``DeprecationWarning``, jax's deprecation
"jax-pallas-triton"): while the user's own ``jit`` lowers, after k3_tail's code has returned. A user whose
warnings are errors (``python -W error``, pytest's ``-W error`` or ``filterwarnings = error``) would then
fail because selection picked one_kernel. jax has no switch that silences it (its deprecation registry
can only turn it into an error), and a filter installed when k3_tail is imported would sit below the
"error" filter that pytest installs at the start of every test. So k3_tail installs its filter while
the kernel is traced, into the warnings context in which the lowering then runs: one "ignore" entry
for this message and category only, first in the filters.
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
    """From now on, in the current warnings context (the innermost ``warnings.catch_warnings`` block, else
    the process), ignore jax's ``DeprecationWarning`` that the Pallas Triton backend is deprecated: call it
    while a Triton kernel is traced, so that the lowering that follows does not warn. Every other warning,
    other DeprecationWarnings included, is filtered as before. Installing it again moves the one entry to
    the front of ``warnings.filters``; it never adds a second."""
    message = re.escape(DEPRECATION_MESSAGE)
    first = warnings.filters[0] if warnings.filters else None
    # Already first (every call of tail_forward on a GPU asks): leave the filters, and the caches that a change of
    # them clears, alone.
    if first is not None and first[0] == "ignore" and first[2] is DeprecationWarning and first[3] is None and (
            getattr(first[1], "pattern", None) == message):
        return
    warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)


def vary_alike(arrays: list) -> tuple[list, object]:
    """``arrays`` (a ``pallas_call``'s inputs) cast to vary over the same mesh axes (their union) inside
    ``jax.shard_map``, and their manual-axis type then, which the kernel's outputs take (outside shard_map: the
    trivial one)."""
    varying = [varying_axes(array) for array in arrays]
    axes = set().union(*varying)
    cast = [_vary_over(array, axes - own) for array, own in zip(arrays, varying, strict=True)]
    aval = jax.typeof(cast[0])
    return cast, getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)


def interpreted(run: Callable[[list], jax.Array], arrays: list) -> jax.Array:
    """``run(arrays)`` for a ``pallas_call`` in interpret mode (``run`` makes the call on its inputs, ``arrays``).
    Inside a ``jax.shard_map`` that types values as varying over its axes (``check_vma=True``, its default),
    Pallas's interpreter takes no varying value (jax 0.10-0.12: "Primitive gather requires varying manual axes
    to match", "Scan carry input and output got mismatched varying manual axes"): there the varying arrays are
    gathered over those axes, each device runs every device's call in turn (``lax.map``) on its slices of them
    and the arrays that vary over none, and keeps its own result. p times the work, with the same values:
    interpret mode is a CPU's run of a GPU kernel, for tests. Elsewhere it is ``run(arrays)``."""
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
    """``array`` cast to vary over the axes ``missing`` too (unchanged when there are none)."""
    return lax.pcast(array, tuple(sorted(missing, key=str)), to="varying") if missing else array


def dot_precision(dtype) -> lax.Precision:
    """A kernel's ``jnp.dot`` precision for operands of ``dtype``: float32 products at float32 precision (Triton
    would take TF32 on NVIDIA), others as they are."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT
