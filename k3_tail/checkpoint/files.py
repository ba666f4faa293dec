"""A checkpoint's safetensors files: which file holds each tensor, and block reads of it.

A checkpoint is a directory with ``model.safetensors.index.json`` (each shard a plain file name in that
directory, symbolic links followed), a directory with one ``model.safetensors``, or one ``.safetensors`` file.
Every file ``safetensors`` refuses, and every tensor of another shape or dtype than expected (never cast), is a
ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, TensorSpec, safe_open

from k3_tail._checks import check_path
from k3_tail.json_files import read_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: its name, safetensors dtype name ("BF16"), shape and file."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    path: Path


def stored_dtype_name(dtype: Any) -> str:
    """The name safetensors stores numpy dtype ``dtype`` under ("bfloat16" -> "BF16"), by its own map."""
    return TensorSpec(dtype=np.dtype(dtype).name, shape=[0], data_ptr=0, data_len=0).dtype


class TensorFiles:
    """A checkpoint's safetensors files opened for reading: its tensor names, where each lies, and block reads.
    Each shard is opened (header checked, file mapped) when first asked for; a read copies only its block.

    Args:
      path: a directory with ``model.safetensors.index.json``, a directory with ``model.safetensors``,
        or a ``.safetensors`` file.

    Raises:
      ValueError: when ``path`` is none of them, the index is malformed or names a shard outside the directory,
        or safetensors refuses a file.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(check_path("checkpoint", path, expected=f"a directory with {INDEX_FILE} or {SINGLE_FILE}, "
                                                           "or a .safetensors file"))
        self.path = path
        self._shards: dict[Path, _Shard] = {}
        if path.is_dir() and (path / INDEX_FILE).exists():
            self._files = _read_index(path / INDEX_FILE)
        elif path.is_dir() and (path / SINGLE_FILE).exists():
            self._files = dict.fromkeys(self._shard(path / SINGLE_FILE).names, path / SINGLE_FILE)
        elif path.exists() and not path.is_dir():
            self._files = dict.fromkeys(self._shard(path).names, path)
        else:
            raise ValueError(f"checkpoint: expected a directory with {INDEX_FILE} or {SINGLE_FILE}, or a "
                             f".safetensors file, got {str(path)!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every tensor name in the checkpoint (vision tensors included), in stored order."""
        return tuple(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def info(self, name: str) -> TensorInfo:
        """Tensor ``name``'s dtype, shape and file; ValueError when it is missing or its file refused."""
        if name not in self._files:
            raise ValueError(f"{name}: missing from the checkpoint")
        path = self._files[name]
        shard = self._shard(path)
        if name not in shard:
            raise ValueError(f"checkpoint: {name}: {INDEX_FILE} maps it to {path.name!r}, which holds no tensor "
                             f"of that name")
        tensor = shard.handle.get_slice(name)
        return TensorInfo(name, tensor.get_dtype(), tuple(tensor.get_shape()), path)

    def expect(self, name: str, shape: Sequence[int], dtype: Any, *, layer: int, what: str,
               dtype_source: str = "config.dtype") -> TensorInfo:
        """:meth:`info` of ``name``, of ``shape`` and ``dtype`` (one or a tuple of accepted ones). ``layer``,
        ``what`` (the tensor is) and ``dtype_source`` (where ``dtype`` comes from) are for the message.

        Raises:
          ValueError: naming ``layer``, the tensor and what was expected, when it is missing (named as stored
            quantised when ``X.weight_packed``, ... stand in its place) or has another shape or dtype.
        """
        shape = tuple(shape)
        dtypes = tuple(np.dtype(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))
        wanted = f"shape {shape} ({what}) of {' or '.join(d.name for d in dtypes)} ({dtype_source})"
        if name not in self._files:
            found = [other for other in self._files if other.startswith(f"{name}_")]  # X.weight_packed, ...
            if found:
                raise ValueError(f"layer {layer}: {name}: missing; the checkpoint holds {found} instead: the "
                                 f"tensor is stored quantised, which this loader does not dequantise (expected "
                                 f"{wanted})")
            raise ValueError(f"layer {layer}: {name}: missing from the checkpoint (expected {wanted})")
        info = self.info(name)
        if info.shape != shape or info.dtype_name not in {stored_dtype_name(d) for d in dtypes}:
            read_as = self._read_dtype(info)
            raise ValueError(f"layer {layer}: {name}: expected {wanted}, got shape {info.shape} of "
                             f"{info.dtype_name if read_as is None else read_as.name}")
        return info

    def read(self, name: str, index: Sequence[slice] = ()) -> np.ndarray:
        """Block ``index`` (one slice of step 1 per leading axis; missing axes whole) of tensor ``name``, in its
        stored dtype, copying only the block's bytes. ValueError for a missing tensor, a dtype numpy lacks (FP8,
        FP4), a bad index, or a file that changed since it was opened."""
        info = self.info(name)
        index = _full_index(name, index, info.shape)
        block_shape = tuple(axis.stop - axis.start for axis in index)
        if info.shape and math.prod(block_shape) == 0:
            read_as = self._read_dtype(info)  # not the block itself: safetensors refuses some empty slices
            if read_as is None:
                raise _unreadable(info)
            return np.zeros(block_shape, read_as)
        shard = self._shard(info.path)
        shard.check_unchanged(name)
        try:
            return shard.handle.get_slice(name)[index]
        except SafetensorError as error:
            raise ValueError(f"checkpoint: {str(info.path)!r}: {name}: safetensors cannot read {index}: "
                             f"{error}") from None
        except AttributeError:  # safetensors builds the array from numpy's type of that name, which numpy lacks
            raise _unreadable(info) from None

    def read_transposed(self, name: str, index: Sequence[slice] = ()) -> np.ndarray:
        """Block ``index`` [rows, columns] of the transpose of the 2-d tensor ``name``: a torch Linear's
        [out, in] weight read as the Flax kernel [in, out] (y = x @ W), reading only the block."""
        info = self.info(name)
        if len(info.shape) != 2:
            raise ValueError(f"{name}: expected a 2-d tensor, got shape {info.shape}")
        rows, columns = _full_index(name, index, info.shape[::-1])
        return np.ascontiguousarray(self.read(name, (columns, rows)).T)

    def _read_dtype(self, info: TensorInfo) -> np.dtype | None:
        """The numpy dtype safetensors reads ``info``'s tensor as, or None (FP8, FP4), from an empty block."""
        shard = self._shard(info.path)
        shard.check_unchanged(info.name)
        empty = () if not info.shape or 0 in info.shape else (slice(0, 0),)
        try:
            return shard.handle.get_slice(info.name)[empty].dtype
        except AttributeError:
            return None

    def _shard(self, path: Path) -> _Shard:
        if path not in self._shards:
            self._shards[path] = _Shard(path)
        return self._shards[path]


def _unreadable(info: TensorInfo) -> ValueError:
    return ValueError(f"{info.name}: stored as {info.dtype_name}, which safetensors' numpy reader does not "
                      "return (numpy has no such type)")


class _Shard:
    """One safetensors file as safetensors opened it, and which file it was then (device, inode, size, mtime).

    Reading a mapped page past the end of a file truncated since kills the process (SIGBUS): hence the check
    before every read."""

    def __init__(self, path: Path):
        self.path = path
        identity = _identity(path)
        try:
            self.handle = safe_open(path, framework="numpy")
        except (SafetensorError, OSError) as error:
            raise ValueError(f"checkpoint: {str(path)!r}: safetensors refuses the file ({error})") from None
        if _identity(path) != identity:
            raise ValueError(f"checkpoint: {str(path)!r}: the file changed while it was being opened")
        self.identity = identity
        self.names = tuple(self.handle.offset_keys())
        self._names = frozenset(self.names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def check_unchanged(self, name: str) -> None:
        """ValueError naming the file and ``name`` when the file is not the one opened, as it was then."""
        now = _identity(self.path)
        if now == self.identity:
            return
        if now[:2] != self.identity[:2]:
            change = "another file has taken its name"
        elif now[2] != self.identity[2]:
            change = f"its size went from {self.identity[2]} to {now[2]} bytes"
        else:
            change = "it was modified"
        raise ValueError(f"checkpoint: {str(self.path)!r}: {name}: the file changed since it was opened ({change}); "
                         "open the checkpoint again")


def _identity(path: Path) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime) of the regular file ``path``; ValueError otherwise (safetensors would wait
    forever on a FIFO)."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"checkpoint: the shard {str(path)!r} is missing") from None
    except OSError as error:
        raise ValueError(f"checkpoint: cannot read {str(path)!r}: {error.strerror}") from None
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"checkpoint: {str(path)!r} is not a regular file; not read")
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _read_index(path: Path) -> dict[str, Path]:
    """tensor name -> shard file, from a ``model.safetensors.index.json``."""
    index = read_json(path, what="checkpoint")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"checkpoint: {str(path)!r} has no weight_map of tensor names to shard files")
    shards: dict[str, Path] = {}
    files = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard not in shards:  # a list would not hash
            shards[shard] = path.parent / _plain_file_name(path, name, shard)
        files[name] = shards[shard]
    return files


def _plain_file_name(index: Path, name: str, shard: Any) -> str:
    """``shard`` when it is a plain file name (no directory part); ValueError naming the entry otherwise."""
    entry = f"checkpoint: {str(index)!r}: weight_map.{name}"
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if isinstance(shard, str) and (shard in ("", ".", "..") or any(separator in shard for separator in separators)):
        raise ValueError(f"{entry}: {shard!r} is not a plain file name; a shard must be a file in the checkpoint's "
                         "own directory (absolute paths, path separators and '..' are refused)")
    return check_path(entry, shard, expected="a shard's file name")


def _full_index(name: str, index: Sequence[slice], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """``index`` with one resolved slice (start, stop) per axis; ValueError unless each is a slice of step 1."""
    index = tuple(index)
    if len(index) > len(shape) or not all(isinstance(axis, slice) for axis in index):
        raise ValueError(f"{name}: expected at most {len(shape)} slices, got {index!r}")
    resolved = []
    for axis, size in zip(index + (slice(None),) * (len(shape) - len(index)), shape, strict=True):
        start, stop, step = axis.indices(size)
        if step != 1:
            raise ValueError(f"{name}: expected slices of step 1, got {axis!r}")
        resolved.append(slice(start, max(start, stop)))
    return tuple(resolved)
