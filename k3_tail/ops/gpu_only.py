"""A compiled GPU kernel lowered for the GPU platforms only, so that a multi-platform program (``jax.export(...,
platforms=("cpu", "cuda", "rocm"))`` lowers every branch for each) can hold it: elsewhere it lowers to NaN and
zeros, as Pallas lowers no compiled kernel for the CPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax._src import effects
from jax._src.interpreters import mlir
from jax.extend import core
from jax.interpreters import batching

from k3_tail.hardware import GPU_VENDOR_PLATFORMS

_gpu_only_p = core.Primitive("k3_tail_gpu_only")
_gpu_only_p.multiple_results = True


def gpu_only(function: Callable[..., tuple[jax.Array, ...]], *operands: jax.Array, platform: str | None = None,
             num_warps: Mapping[str, int] | None = None) -> tuple[jax.Array, ...]:
    """``function(*operands)`` (arrays in, a tuple of arrays out), lowered only for ``platform`` ("cuda" or
    "rocm"; "gpu" or None: both). ``num_warps``: the warps of its Pallas Triton calls per GPU platform, set as each
    lowers. vmap batches it as ``function`` does; not differentiable (callers give it a custom JVP)."""
    closed = jax.make_jaxpr(lambda *arrays: tuple(function(*arrays)))(*operands)
    platforms = GPU_VENDOR_PLATFORMS if platform not in GPU_VENDOR_PLATFORMS else (platform,)
    warps = () if num_warps is None else tuple(sorted(num_warps.items()))
    return tuple(_gpu_only_p.bind(*operands, jaxpr=closed, platforms=platforms, num_warps=warps))


def _abstract_eval(*_, jaxpr, platforms, num_warps):
    return jaxpr.out_avals


def _with_warps(jaxpr, warps: int | None):
    """``jaxpr`` with its Pallas Triton calls' warps set to ``warps`` (None: as traced)."""
    if warps is None:
        return jaxpr
    eqns = [eqn.replace(params={**eqn.params, "compiler_params": dataclasses.replace(
                eqn.params["compiler_params"], num_warps=warps)}) if eqn.primitive.name == "pallas_call" else eqn
            for eqn in jaxpr.jaxpr.eqns]
    return jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(eqns=eqns))


def _lowering(ctx, *operands, jaxpr, platforms, num_warps):
    warps = dict(num_warps)
    kernels = {platform: mlir.lower_fun(core.jaxpr_as_fun(_with_warps(jaxpr, warps.get(platform))),
                                        multiple_results=True) for platform in platforms}
    avals = jaxpr.out_avals

    def never_runs(*_):  # on the platforms where the conditional around the kernel takes another branch
        return [jnp.full(aval.shape, jnp.nan if jnp.issubdtype(aval.dtype, jnp.inexact) else 0, aval.dtype)
                for aval in avals]

    return mlir.lower_per_platform(ctx, "k3_tail_gpu_only", kernels,
                                   mlir.lower_fun(never_runs, multiple_results=True), effects.no_effects, *operands)


def _batched(operands, dims, *, jaxpr, platforms, num_warps):
    batched = jax.make_jaxpr(jax.vmap(core.jaxpr_as_fun(jaxpr), in_axes=dims))(*operands)
    outputs = tuple(_gpu_only_p.bind(*operands, jaxpr=batched, platforms=platforms, num_warps=num_warps))
    return outputs, [0] * len(outputs)


_gpu_only_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_gpu_only_p, _lowering)
batching.primitive_batchers[_gpu_only_p] = _batched
