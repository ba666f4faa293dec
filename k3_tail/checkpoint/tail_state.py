"""A tail's saved ``nnx.state`` restored at another TP size or layout. A column-layout kernel is
[L, padded_hidden_size(H, p)], which orbax alone cannot restore at another p: its zero padding columns are
checked, dropped and padded again to the new width."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail._checks import AxisName, check_axis_name, check_mesh, check_path, expect_array, expect_rank
from k3_tail.config import TailConfig, check_config
from k3_tail.ops.columns import check_weight_layout, pad_columns, padded_hidden_size

# The entries of a LatentMoETail's state: its parameters' attribute names.
KERNEL, SCALE, NORM = "up_proj_kernel", "up_proj_scale", "norm_scale"


def restore_tail_state(
    checkpoint: str | os.PathLike | Mapping,
    *,
    config: TailConfig,
    mesh: Mesh,
    axis_name: AxisName = "tp",
    weight_layout: str = "column",
) -> nnx.State:
    """The state of a :class:`k3_tail.LatentMoETail` of ``config`` on ``mesh``, from a tail's state saved at any p.

    Args:
      checkpoint: the directory orbax's ``StandardCheckpointer`` saved a tail's ``nnx.state`` to (each device
        reads only its block), or such a state in memory (``nnx.State``, orbax's nested dict or
        ``nnx.to_pure_dict``'s), of a tail of the same H, L, dtypes and norm, on any p, in either layout.
      config: the tail's :class:`k3_tail.TailConfig`.
      mesh: the Mesh the tail runs on (p' ranks along ``axis_name``).
      axis_name: the TP axis.
      weight_layout: the tail's layout, "column" or "replicated".

    Returns:
      The state ``nnx.update`` and ``nnx.merge`` take, as the tail's constructor makes it: ``up_proj_kernel``
      [L, Hs] (FP8: with ``up_proj_scale`` float32 [Hs]), Hs = padded_hidden_size(H, p') split on dim 1 for
      "column", H replicated for "replicated", its first H columns the saved ones bit for bit and the rest
      zero; ``norm_scale`` [L] replicated.

    Raises:
      ValueError: naming the argument, for a bad config, mesh, axis, layout or ``checkpoint``; naming
        ``checkpoint`` and the entry, for a missing or unknown entry, another L or dtype, a kernel narrower than
        H, a scale of another width or an entry that is no array (before any array is read), and nonzero padding
        (before anything is placed on ``mesh``).
    """
    check_config(config)
    axis_name = check_axis_name(axis_name)
    tp_size = check_mesh(mesh, axis_name)
    columns = axis_name if check_weight_layout(weight_layout) == "column" else None
    width = padded_hidden_size(config.hidden_size, tp_size) if columns is not None else config.hidden_size
    if isinstance(checkpoint, Mapping):
        saved = _entries(checkpoint)
        _check_entries(saved, config)
        for name, value in saved.items():
            if not isinstance(value, (np.ndarray, jax.Array)):  # an abstract state's ShapeDtypeStruct
                raise ValueError(f"checkpoint: {name}: expected an array (numpy or jax), got {type(value).__name__}")
    elif isinstance(checkpoint, (str, os.PathLike)):
        saved = _read(check_path("checkpoint", checkpoint, expected="an orbax checkpoint directory"),
                      config=config, mesh=mesh, columns=columns, tp_size=tp_size, width=width)
    else:
        raise ValueError(f"checkpoint: expected an orbax checkpoint directory or a LatentMoETail's nnx.State, "
                         f"got {type(checkpoint).__name__}")
    for name in (KERNEL, SCALE):
        if name in saved:
            _check_padding(name, saved[name], config.hidden_size)
    # The shardings the tail's constructor gives its parameters.
    specs = {KERNEL: (None, columns), SCALE: (columns,), NORM: (None,)}
    state = {}
    for name, value in saved.items():
        sharding = NamedSharding(mesh, P(*specs[name]))
        value = (jax.device_put(value, sharding) if name == NORM
                 else _recut(value, width=width, sharding=sharding, tp_size=tp_size))
        state[name] = _param(value, specs[name], mesh)
    return nnx.State(state)


def _entries(state: Mapping) -> dict[str, Any]:
    """name -> array (or orbax's ArrayMetadata) of a state's entries, in any of the forms it takes."""
    entries = {}
    for name, entry in state.items():
        if isinstance(entry, nnx.Variable):
            entry = entry.get_value()
        elif isinstance(entry, Mapping) and set(entry) == {"value"}:
            entry = entry["value"]
        entries[name] = entry
    return entries


def _check_entries(saved: dict[str, Any], config: TailConfig) -> None:
    """ValueError naming ``checkpoint`` and the entry unless ``saved``'s shapes and dtypes are ``config``'s tail's."""
    fp8, latent, hidden = config.up_proj_dtype, config.latent_size, config.hidden_size
    needed = {KERNEL: "the up projection's kernel",
              SCALE: f"config.up_proj_dtype = {None if fp8 is None else fp8.name}",
              NORM: f"config.use_latent_norm = {config.use_latent_norm}"}
    wanted = {KERNEL, *([SCALE] if fp8 is not None else []), *([NORM] if config.use_latent_norm else [])}
    for name in saved:
        if name not in needed:
            raise ValueError(f"checkpoint: {name!r}: no entry of a LatentMoETail's state ({', '.join(needed)}); "
                             "pass the tail's own state (its sub-state in a model's)")
        if name not in wanted:
            raise ValueError(f"checkpoint: {name}: saved, but a tail of {needed[name]} has none")
    missing = sorted(wanted - set(saved))
    if missing:
        raise ValueError(f"checkpoint: no {missing[0]}, which a tail of {needed[missing[0]]} has")
    kernel = saved[KERNEL]
    expect_rank(kernel, f"checkpoint: {KERNEL}", "[L, Hs]", 2)
    if kernel.shape[0] != latent:
        raise ValueError(f"checkpoint: {KERNEL}: expected [L, Hs] with L = {latent} (config.latent_size), "
                         f"got shape {tuple(kernel.shape)}")
    if kernel.shape[1] < hidden:
        raise ValueError(f"checkpoint: {KERNEL}: {kernel.shape[1]} columns, fewer than H = {hidden} "
                         f"(config.hidden_size): the state of a tail of another H")
    dtype, field = (config.dtype, "config.dtype") if fp8 is None else (fp8, "config.up_proj_dtype")
    if jnp.dtype(kernel.dtype) != dtype:
        raise ValueError(f"checkpoint: {KERNEL}: expected dtype {dtype.name} ({field}), "
                         f"got {jnp.dtype(kernel.dtype).name}")
    if fp8 is not None:
        expect_array(saved[SCALE], f"checkpoint: {SCALE}", [(kernel.shape[1],)], np.dtype(np.float32),
                     f"one scale per column of {KERNEL}", dtype_field="the kernel's per-column scales")
    if config.use_latent_norm:
        expect_array(saved[NORM], f"checkpoint: {NORM}", [(latent,)], config.dtype, f"L={latent}")


def _read(directory: str, *, config: TailConfig, mesh: Mesh, columns: AxisName | None, tp_size: int,
          width: int) -> dict:
    """The arrays of the orbax checkpoint in ``directory``, checked by their metadata, then read onto ``mesh``
    (for "column" widened with zero columns to a multiple of p' >= ``width``, so :func:`_recut` cuts in place)."""
    import orbax.checkpoint as ocp  # flax's dependency, loaded for a restore from a directory only

    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint: {directory!r} is no directory (the one StandardCheckpointer saved to)")
    checkpointer = ocp.StandardCheckpointer()
    path = os.path.abspath(directory)  # orbax finds no checkpoint at a relative path
    try:
        tree = getattr(checkpointer.metadata(path).item_metadata, "tree", None)
        if not isinstance(tree, Mapping):
            raise ValueError(f"checkpoint: {directory!r}: no orbax checkpoint of a tree there "
                             "(StandardCheckpointer().save(directory, nnx.state(tail)) writes one)")
        saved = _entries(tree)
        _check_entries(saved, config)
        target = {}
        for name, entry in saved.items():
            shape, spec = tuple(entry.shape), P()
            if name != NORM and columns is not None:
                shape = shape[:-1] + (-(-max(shape[-1], width) // tp_size) * tp_size,)
                spec = P(None, columns) if name == KERNEL else P(columns)
            target[name] = {"value": jax.ShapeDtypeStruct(shape, entry.dtype, sharding=NamedSharding(mesh, spec))}
        # strict=False lets orbax fill the columns past the saved width with zeros; it never truncates here, as
        # every target is at least as wide as the saved array.
        return _entries(checkpointer.restore(path, target, strict=False))
    finally:
        checkpointer.close()


def _check_padding(name: str, x: Any, hidden: int) -> None:
    """ValueError naming ``checkpoint`` and ``name`` when a column of ``x`` from ``hidden`` on is not zero."""
    if x.shape[-1] > hidden and bool(_nonzero_past(x, hidden)):
        raise ValueError(f"checkpoint: {name}: its columns from H = {hidden} (config.hidden_size) on are padding, "
                         "zero in every tail's state, but hold nonzero values: the state of a tail of another H, or "
                         "a damaged one")


@functools.partial(jax.jit, static_argnums=1)
def _nonzero_past(x: jax.Array, hidden: int) -> jax.Array:
    """Whether a column of ``x`` from ``hidden`` on is nonzero (a mask, not a slice: any sharding runs it)."""
    column = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.any((x != 0) & (column >= hidden))


def _recut(x: Any, *, width: int, sharding: NamedSharding, tp_size: int) -> jax.Array:
    """``x`` [..., W] (columns past H zero) as [..., width] placed in ``sharding``."""
    if x.shape[-1] == width:
        return jax.device_put(x, sharding)
    # Slicing or padding a sharded axis takes a width that divides into its shards; any other is held
    # replicated on the new mesh for the cut (one whole kernel a device, for this call only).
    held = sharding if x.shape[-1] % tp_size == 0 else NamedSharding(sharding.mesh, P())
    return jax.jit(lambda v: pad_columns(v[..., :width], width), out_shardings=sharding)(jax.device_put(x, held))


def _param(value: jax.Array, spec: tuple, mesh: Mesh) -> nnx.Param:
    """An ``nnx.Param`` of ``value`` annotated with ``spec``, as the tail's constructor makes it."""
    return nnx.Param(nnx.with_partitioning(lambda: value, spec, mesh=mesh)())
