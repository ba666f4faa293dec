"""Compile one tail call ahead of time, with the per-executable XLA options of its tier (they override the
user's ``XLA_FLAGS``, so no flag undoes a schedule the tier rests on). A model that calls the tail inside its own
``jit`` passes :func:`compiler_options` to its own ``.compile(compiler_options=...)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail._checks import AxisName, check_int, check_mesh
from k3_tail.config import TailConfig, check_config
from k3_tail.forward import lowered_tail, resolved_tier
from k3_tail.hardware import check_platform
from k3_tail.ops.columns import check_weight_layout, padded_hidden_size
from k3_tail.ops.tokens import padded_token_count
from k3_tail.ops.up_projection import QuantizedKernel, column_sharding
from k3_tail.output_files import check_output_directory
from k3_tail.tiers.registry import Tier


def compiler_options(tier: Tier | str, platform: str | jax.Device) -> dict[str, Any]:
    """The per-executable XLA options the library applies to ``tier``.

    Args:
      tier: a :class:`k3_tail.Tier` or its value.
      platform: a device of the program's mesh, or "gpu", "cuda", "rocm", "cpu", "tpu" (ValueError otherwise).

    Returns:
      The tier record's ``compiler_options`` for that platform's family (empty when it needs none).
    """
    return Tier.parse(tier).record.options_for(check_platform(platform))


def tail_arguments(
    config: TailConfig, mesh: Mesh, num_tokens: int, *, axis_name: AxisName = "tp", weight_layout: str = "replicated"
) -> tuple[jax.ShapeDtypeStruct | None, ...]:
    """Abstract arguments of one :func:`k3_tail.tail_forward` call, placed on ``mesh``.

    Args:
      config: the tail's :class:`k3_tail.TailConfig`.
      mesh: the Mesh, with the TP axis ``axis_name``.
      num_tokens: T.
      axis_name: the TP axis.
      weight_layout: "replicated" or "column".

    Returns:
      ``(routed, shared, norm_weight, kernel)`` as ``jax.ShapeDtypeStruct``: routed [p, T, L] split on dim 0
      ([T, L] replicated with ``config.routed_output_is_reduced``); shared [p, T, H] split on dim 0 ([T, H] with
      ``config.shared_output_is_reduced``: split over tokens with ``config.sequence_parallel`` where p divides
      T > 0, else replicated), or None; norm weight [L] replicated, or None; kernel [L, H] replicated, or
      [L, padded_hidden_size(H, p)] split on dim 1 for "column", a :class:`k3_tail.QuantizedKernel` (float32
      scales split alike) with an FP8 ``config.up_proj_dtype``.
    """
    tp_size = check_mesh(mesh, axis_name)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    weight_layout = check_weight_layout(weight_layout)
    latent, hidden = config.latent_size, config.hidden_size

    def array(shape, spec):
        return jax.ShapeDtypeStruct(shape, config.dtype, sharding=NamedSharding(mesh, spec))

    if config.routed_output_is_reduced:
        routed = array((num_tokens, latent), P())
    else:
        routed = array((tp_size, num_tokens, latent), P(axis_name))
    shared = None
    if config.shared_output_is_reduced:
        # Split over tokens where [T, H] splits evenly (tail_forward pads it to T' rows and places it).
        splits = config.sequence_parallel and padded_token_count(num_tokens, tp_size) == num_tokens
        shared = array((num_tokens, hidden), P(axis_name) if splits else P())
    elif config.has_shared_experts:
        shared = array((tp_size, num_tokens, hidden), P(axis_name))
    norm_weight = array((latent,), P()) if config.use_latent_norm else None
    width = padded_hidden_size(hidden, tp_size) if weight_layout == "column" else hidden
    columns = axis_name if weight_layout == "column" else None
    if config.up_proj_dtype is None:
        kernel = jax.ShapeDtypeStruct((latent, width), config.dtype)
    else:
        kernel = QuantizedKernel(jax.ShapeDtypeStruct((latent, width), config.up_proj_dtype),
                                 jax.ShapeDtypeStruct((width,), jnp.float32))
    kernel = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                          kernel, column_sharding(kernel, mesh, columns))
    return routed, shared, norm_weight, kernel


def compile_tail(
    config: TailConfig,
    mesh: Mesh,
    num_tokens: int,
    *,
    tier: Tier | str | None = None,
    axis_name: AxisName = "tp",
    weight_layout: str = "replicated",
    dump_to: str | os.PathLike | None = None,
    xla_options: Mapping[str, Any] | None = None,
) -> jax.stages.Compiled:
    """The compiled executable of one :func:`k3_tail.tail_forward` call for T = ``num_tokens`` on ``mesh``, with
    :func:`compiler_options` applied.

    Args:
      config: the tail's :class:`k3_tail.TailConfig`.
      mesh: a Mesh of real devices or of a deviceless topology (:func:`k3_tail.topology_mesh`).
      num_tokens: T.
      tier: a :class:`k3_tail.Tier` (or its value), or None for what :func:`k3_tail.select_tier` picks.
      axis_name: the TP axis.
      weight_layout: "replicated" or "column".
      dump_to: a directory for XLA's dump (``xla_dump_to``; ``report(compiled, dump_dir=dump_to)`` reads it),
        created once every other argument is checked; None: no dump.
      xla_options: further XLA options (names to values), over the tier's; XLA refuses an unknown name.

    Returns:
      The ``jax.stages.Compiled`` program. Its arguments are :func:`tail_arguments` in that order,
      flat, Nones dropped (an FP8 kernel is two: values, then scales), so the shared partial is argument 1,
      and after them the per-rank inputs the tier reads (:func:`k3_tail.forward.lowered_tail`).

    Raises:
      ValueError: naming the argument, for a bad config, mesh, token count, tier, layout or ``xla_options``, or a
        ``dump_to`` that cannot be a directory, before compiling.
    """
    check_config(config)
    if xla_options is not None and (not isinstance(xla_options, Mapping)
                                    or not all(isinstance(name, str) for name in xla_options)):
        raise ValueError(f"xla_options: expected a mapping of XLA option names to values, or None, got "
                         f"{xla_options!r}")
    arguments = tail_arguments(config, mesh, num_tokens, axis_name=axis_name, weight_layout=weight_layout)
    device = mesh.devices.flat[0]
    resolved = resolved_tier(config, num_tokens, mesh, axis_name, tier, weight_layout)
    if dump_to is not None:  # the last check: the directory is made, so only once every argument is good
        dump_to = check_output_directory("dump_to", dump_to, expected="a directory for XLA's dump")

    options = compiler_options(resolved, device) | dict(xla_options or {})
    if dump_to is not None:
        options["xla_dump_to"] = dump_to
    lowered = lowered_tail(config, mesh, arguments, axis_name=axis_name, tier=resolved, weight_layout=weight_layout)
    return lowered.compile(compiler_options=options)

