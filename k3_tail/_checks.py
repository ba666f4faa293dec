"""Argument checks shared by the entry points: each raises ValueError naming the argument."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

# A TP axis: one mesh axis name, or a tuple of them (a TP group spread over several mesh axes).
AxisName = str | tuple[str, ...]


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """``value`` as an int, or ValueError naming ``name`` when it is not an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def check_path(name: str, path: Any, *, expected: str) -> str:
    """``path`` as a str, or ValueError naming ``name`` unless it is a non-empty str or os.PathLike that the file
    system can take (no NUL byte, encodable, no name too long: asked with an ``lstat``, whose other errors are
    the caller's), each of which would surface later naming nothing. ``expected``: what the path stands for."""
    if not isinstance(path, (str, os.PathLike)) or not (text := os.fsdecode(path)):
        raise ValueError(f"{name}: expected {expected}, got {path!r}")
    if "\0" in text:
        raise ValueError(f"{name}: {text!r} holds a NUL byte, which no file name can")
    try:
        os.fsencode(text)
    except UnicodeEncodeError as error:
        raise ValueError(f"{name}: {text!r} cannot be a file name here: the file system's encoding "
                         f"({sys.getfilesystemencoding()}) cannot encode {error.object[error.start:error.end]!r} "
                         f"({error.reason})") from None
    try:
        os.lstat(text)
    except OSError as error:
        if error.errno == errno.ENAMETOOLONG:
            raise ValueError(f"{name}: {text!r} cannot be a file name here: the file system takes no name this "
                             f"long ({len(os.fsencode(text))} bytes; {error.strerror})") from None
    return text


def check_axis_name(axis_name: Any) -> str | tuple[str, ...]:
    """``axis_name`` unchanged: one mesh axis name, or a non-empty tuple of distinct names (a TP group
    spread over several mesh axes, ranks ordered major to minor as listed)."""
    if isinstance(axis_name, str) and axis_name:
        return axis_name
    if (isinstance(axis_name, tuple) and axis_name and len(set(axis_name)) == len(axis_name)
            and all(isinstance(name, str) and name for name in axis_name)):
        return axis_name
    raise ValueError(f"axis_name: expected a mesh axis name or a tuple of distinct axis names, got {axis_name!r}")


def axis_names(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
    """``axis_name`` as a tuple of mesh axis names."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def axis_size_in_scope(axis_name: AxisName, function: str) -> int:
    """p: the size of the TP axis ``axis_name`` of the enclosing ``jax.shard_map`` (the product over a
    tuple), or ValueError naming ``axis_name`` when ``function`` is called outside one with that axis."""
    try:
        return lax.axis_size(axis_name)
    except NameError as error:
        raise ValueError(
            f"axis_name: {axis_name!r} is not a mesh axis here; call {function} inside jax.shard_map over a "
            f"mesh with that axis ({error})"
        ) from None


def variation_over(axis_name: AxisName, values: Mapping[str, Any]) -> dict[str, bool] | None:
    """Whether each of ``values`` (by name; None values left out) is typed inside ``jax.shard_map`` as varying over
    the TP axis (a per-rank partial: True) or not (a sum over it, or a replicated input: False); None where the
    types cannot tell (``check_vma=False``, or an axis of size 1)."""
    names = set(axis_names(axis_name))
    variation = {name: bool(names & varying_axes(value)) for name, value in values.items() if value is not None}
    # Where nothing varies, a probe cast to vary tells whether the types track variation at all.
    if not any(variation.values()):
        probe = lax.pcast(jnp.zeros((), jnp.float32), tuple(names), to="varying")
        if not names & varying_axes(probe):
            return None
    return variation


def varying_axes(x: Any) -> set:
    """The mesh axes ``x``'s type says it varies over (``jax.typeof(x).vma``; jax 0.10-0.12 keep them
    in ``.mat.varying``)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", ())
    return set(vma)


def check_mesh(mesh: Any, axis_name: AxisName) -> int:
    """The TP size p: the size of ``mesh`` along ``axis_name`` (the product over a tuple of axes), or
    ValueError when ``mesh`` is no Mesh with those axes."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    size = 1
    for name in axis_names(check_axis_name(axis_name)):
        if name not in mesh.axis_names:
            raise ValueError(f"mesh: expected a mesh axis named {name!r} (axis_name), got axes {mesh.axis_names}")
        size *= mesh.shape[name]
    return size


def expect_rank(x: Any, name: str, layout: str, ndim: int) -> None:
    """ValueError naming ``name`` unless ``x`` is an array with ``ndim`` dimensions (``layout`` says which)."""
    if x is None or not hasattr(x, "shape") or len(x.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array {layout}, got {describe(x)}")


def describe(x: Any) -> str:
    """What ``x`` is, for a message: "None", "a bfloat16 array of shape (4, 8)", "a list (not an array:
    np.asarray makes one)"."""
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a {np.dtype(x.dtype).name} array of shape {tuple(x.shape)}"
    return f"a {type(x).__name__} (not an array: np.asarray makes one)"


def expect_array(
    x: Any, name: str, shapes: Sequence[tuple[int, ...]], dtype: np.dtype, sizes: str, *,
    dtype_field: str = "config.dtype", shape_hint: Callable[[tuple[int, ...]], str | None] | None = None,
    none_because: str | None = None,
) -> None:
    """ValueError naming ``name`` unless ``x`` is an array of one of ``shapes`` and of ``dtype``; ``sizes``
    ("p=8, L=3584") and ``dtype_field`` say where they come from, for the message, and ``shape_hint(shape)``
    (when given and not None) the likely fix for a wrong shape. With ``none_because`` (why), ``x`` must be None."""
    if none_because is not None:
        if x is not None:
            raise ValueError(f"{name}: expected None because {none_because}")
        return
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name}: expected an array of shape {shapes[0]}, got {describe(x)}")
    if tuple(x.shape) not in shapes:
        wanted = " or ".join(str(s) for s in shapes)
        hint = None if shape_hint is None else shape_hint(tuple(x.shape))
        raise ValueError(f"{name}: expected shape {wanted} ({sizes}), got {tuple(x.shape)}"
                         + ("" if hint is None else f"; {hint}"))
    if jnp.dtype(x.dtype) != dtype:
        raise ValueError(f"{name}: expected dtype {dtype.name} ({dtype_field}), got {jnp.dtype(x.dtype).name}")
