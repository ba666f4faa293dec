"""A compiled GPU kernel lowered for the GPU platforms only, so that a multi-platform program can hold it.

:mod:`k3_tail.selection.lowering` puts a GPU kernel (a Pallas Triton call) in the branch of
``jax.lax.platform_dependent`` that CUDA and ROCm take. A lowering for several platforms at once
(``jax.export(..., platforms=("cpu", "cuda", "rocm"))``) lowers every branch for every one of them, and Pallas
refuses to lower a compiled kernel for the CPU, although the CPU never runs that branch. :func:`gpu_only` binds
the kernel's function as one primitive whose lowering is the function's own on the GPU platform of its branch
(lowered for that platform alone) and, on any other platform, NaN and zeros of the outputs' types: code the conditional
around it never runs there, and never a plausible result if something did.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax._src import effects
from jax._src.interpreters import mlir
from jax.extend import core
from jax.interpreters import batching

from k3_tail.hardware import GPU_VENDOR_PLATFORMS

_gpu_only_p = core.Primitive("k3_tail_gpu_only")
_gpu_only_p.multiple_results = True


def gpu_only(function: Callable[..., tuple[jax.Array, ...]], *operands: jax.Array,
             platform: str | None = None) -> tuple[jax.Array, ...]:
    """``function(*operands)`` (arrays in, a tuple of arrays out), lowered only for ``platform`` ("cuda" or
    "rocm"; None: both), the platform its branch runs on (module docstring). It is traced here once; vmap batches
    it as ``function`` batches. Not differentiable: callers wrap it in a custom VJP."""
    closed = jax.make_jaxpr(lambda *arrays: tuple(function(*arrays)))(*operands)
    platforms = GPU_VENDOR_PLATFORMS if platform not in GPU_VENDOR_PLATFORMS else (platform,)
    return tuple(_gpu_only_p.bind(*operands, jaxpr=closed, platforms=platforms))


def _abstract_eval(*_, jaxpr, platforms):
    return jaxpr.out_avals


def _lowering(ctx, *operands, jaxpr, platforms):
    kernel = mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)
    avals = jaxpr.out_avals

    def never_runs(*_):  # on the platforms where the conditional around the kernel takes another branch
        return [jnp.full(aval.shape, jnp.nan if jnp.issubdtype(aval.dtype, jnp.inexact) else 0, aval.dtype)
                for aval in avals]

    return mlir.lower_per_platform(ctx, "k3_tail_gpu_only", dict.fromkeys(platforms, kernel),
                                   mlir.lower_fun(never_runs, multiple_results=True), effects.no_effects, *operands)


def _batched(operands, dims, *, jaxpr, platforms):
    outputs = tuple(_gpu_only_p.bind(*operands, jaxpr=jax.make_jaxpr(jax.vmap(core.jaxpr_as_fun(jaxpr), in_axes=dims))(
        *operands), platforms=platforms))
    return outputs, [0] * len(outputs)


_gpu_only_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_gpu_only_p, _lowering)
batching.primitive_batchers[_gpu_only_p] = _batched
