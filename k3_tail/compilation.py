"""Compile one tail call ahead of time, with the per-executable XLA options the library chooses.

The options (:func:`compiler_options`, per tier and platform) protect what a tier's schedule rests
on from XLA's defaults and from the user's ``XLA_FLAGS`` (per-executable options override flags):

- overlap, on GPU: ``xla_gpu_all_reduce_combine_threshold_bytes=0``, because in a program with more
  than one tail the all-reduce combiner merges the shared all-reduce with others and nothing
  overlaps (see :mod:`k3_tail.overlap`), and ``xla_gpu_disable_async_collectives=""``, because a
  synchronous all-reduce (``XLA_FLAGS=--xla_gpu_disable_async_collectives=ALLREDUCE``) hides
  behind nothing.
- scatter-gather, on GPU: async collectives pinned on, for the reduce-scatter that runs beside
  the GEMM.
- native and column-parallel: none; their collectives are serial by data dependence. One-shot:
  none; it has one collective. CPU: none; its collectives are synchronous.

A model that calls the tail inside its own ``jit`` passes the same options to its own
``.compile(compiler_options=...)`` to keep the overlap there.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail.columns import check_weight_layout, padded_hidden_size
from k3_tail.config import TailConfig, check_int
from k3_tail.forward import check_mesh, tail_forward
from k3_tail.selection import Tier, select_tier

_ASYNC_COLLECTIVES = {"xla_gpu_disable_async_collectives": ""}
_GPU_OPTIONS = MappingProxyType({
    Tier.NATIVE: MappingProxyType({}),
    Tier.OVERLAP: MappingProxyType({**_ASYNC_COLLECTIVES, "xla_gpu_all_reduce_combine_threshold_bytes": 0}),
    Tier.COLUMN_PARALLEL: MappingProxyType({}),
    Tier.SCATTER_GATHER: MappingProxyType(_ASYNC_COLLECTIVES),
    Tier.ONE_SHOT: MappingProxyType({}),
})


def compiler_options(tier: Tier | str, platform: str) -> dict[str, Any]:
    """The per-executable XLA options the library applies to ``tier`` on ``platform`` (a device's
    ``.platform``: "gpu" for CUDA and ROCm devices alike, "cpu", ...). See the module docstring."""
    tier = Tier.parse(tier)
    return dict(_GPU_OPTIONS[tier]) if platform in ("gpu", "cuda", "rocm") else {}


def tail_arguments(
    config: TailConfig, mesh: Mesh, num_tokens: int, *, axis_name: str = "tp", weight_layout: str = "replicated"
) -> tuple[jax.ShapeDtypeStruct | None, ...]:
    """Abstract (routed, shared, norm_weight, kernel) arguments of one :func:`tail_forward` call.

    Shapes and shardings: routed [p, T, L] split over ``axis_name`` on dim 0 ([T, L] replicated when
    ``config.fused_output_is_reduced``); shared [p, T, H] split on dim 0, or None without shared
    experts; norm weight [L] replicated, or None without the norm; kernel [L, H] replicated, or the
    padded [L, padded_hidden_size(H, p)] column storage split on dim 1 for ``weight_layout="column"``.
    """
    tp_size = check_mesh(mesh, axis_name)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    weight_layout = check_weight_layout(weight_layout)
    latent, hidden = config.latent_size, config.hidden_size

    def array(shape, spec):
        return jax.ShapeDtypeStruct(shape, config.dtype, sharding=NamedSharding(mesh, spec))

    if config.fused_output_is_reduced:
        routed = array((num_tokens, latent), P())
    else:
        routed = array((tp_size, num_tokens, latent), P(axis_name))
    shared = array((tp_size, num_tokens, hidden), P(axis_name)) if config.has_shared_experts else None
    norm_weight = array((latent,), P()) if config.use_latent_norm else None
    if weight_layout == "column":
        kernel = array((latent, padded_hidden_size(hidden, tp_size)), P(None, axis_name))
    else:
        kernel = array((latent, hidden), P())
    return routed, shared, norm_weight, kernel


def compile_tail(
    config: TailConfig,
    mesh: Mesh,
    num_tokens: int,
    *,
    tier: Tier | str | None = None,
    axis_name: str = "tp",
    weight_layout: str = "replicated",
) -> jax.stages.Compiled:
    """The compiled executable of one :func:`tail_forward` call for T = ``num_tokens`` on ``mesh``.

    ``mesh`` may hold real devices or those of a deviceless topology
    (:func:`k3_tail.topologies.topology_mesh`); ``tier`` None compiles what :func:`select_tier`
    picks. The program's arguments are :func:`tail_arguments` in that order (flat, Nones dropped),
    so the shared partial is argument 1. :func:`compiler_options` of the tier and the mesh's
    platform are applied. Inspect it with :func:`k3_tail.xla_report.report`.
    """
    if not isinstance(config, TailConfig):
        raise ValueError(f"config: expected a k3_tail.TailConfig, got {type(config).__name__}")
    arguments = tail_arguments(config, mesh, num_tokens, axis_name=axis_name, weight_layout=weight_layout)
    if tier is None:
        tier = select_tier(
            config, num_tokens, mesh.shape[axis_name], weight_layout=weight_layout,
            device_kind=mesh.devices.flat[0].device_kind,
        ).tier
    resolved = Tier.parse(tier)

    def call(routed, shared, norm_weight, kernel):
        return tail_forward(
            routed, shared, norm_weight, kernel,
            config=config, mesh=mesh, axis_name=axis_name, tier=resolved, weight_layout=weight_layout,
        )

    platform = mesh.devices.flat[0].platform
    return jax.jit(call).lower(*arguments).compile(compiler_options=compiler_options(resolved, platform))

