"""The tail's weights from a Hugging Face checkpoint, read so that each device reads only its own block.

A checkpoint is a directory with ``model.safetensors.index.json`` (its ``weight_map`` names each
tensor's shard: a plain file name in that directory, symbolic links followed, as the Hugging Face hub's
cache keeps its snapshots), a directory with one ``model.safetensors``, or one ``.safetensors`` file.
The text model's decoder layers sit under one of three prefixes, N in decimal without leading zeros
(a name under ``layers.01.`` is refused: no layer has that index):

    language_model.model.layers.N.   Kimi-K3 (its multimodal wrapper: the vision tower beside it)
    language_model.layers.N.         the same, as vLLM and SGLang also accept it
    model.layers.N.                  a text-only model of the family

A MoE layer's block is ``block_sparse_moe`` (a dense layer's is ``mlp``), holding

    block_sparse_moe.routed_expert_up_proj.weight   [H, L]  torch's [out, in]: the kernel W [L, H] transposed
    block_sparse_moe.routed_expert_norm.weight      [L]     the RMSNorm scale g (with latent_moe_use_norm)

Column k of the kernel is row k of the stored tensor, so a column block [L, Hb] is one contiguous run of
stored rows: each device reads exactly those rows (``get_slice(name)[rows]``) and the whole kernel is
never in one place (on Kimi-K3 at p = 8: 6.4 MB per device instead of 51 MB). An FP8 kernel is
quantised block by block as it is read, since a column's scale needs only that column.

The files are read by Hugging Face's ``safetensors`` package (``safe_open(path, framework="numpy")``),
which checks a file's whole header when it opens it: UTF-8 JSON of at most 100 MB, dims and byte
offsets non-negative integers, the offsets tiling the data section exactly, each byte count that of
its dtype and shape. Every file it refuses is a ValueError naming the file, with its reason (which
names the tensor when one is at fault). Its numpy reader returns no FP8 or FP4 arrays (numpy has no
such types; it raises AttributeError), so a tensor stored in one is refused by name (no tensor the
tail or the example layer reads is: the release stores BF16, F32 and U8). The package maps a file into
memory, and reading a mapped page past the end of a file truncated since would kill the process
(SIGBUS): a file that changed since it was opened (size, inode or modification time) is refused before
each read, so only a change during one read's copy could slip by. A tensor of another shape or dtype
than the config says is refused, never cast; one stored quantised (compressed-tensors'
``weight_packed``) is named as such.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import SafetensorError, safe_open

from k3_tail._checks import AxisName, check_axis_name, check_int, check_mesh
from k3_tail.config import TailConfig, check_config
from k3_tail.json_files import read_json
from k3_tail.ops.columns import check_weight_layout, padded_hidden_size
from k3_tail.ops.up_projection import QuantizedKernel, quantize_up_proj

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Where the text model's decoder layers sit (module docstring), the wrapped forms first.
LAYER_PREFIXES = ("language_model.model.layers.", "language_model.layers.", "model.layers.")
MOE_BLOCK, DENSE_BLOCK = "block_sparse_moe", "mlp"
UP_PROJ, NORM = "routed_expert_up_proj.weight", "routed_expert_norm.weight"

# The stored dtypes safetensors' numpy reader returns, and as what (little-endian, as the format stores them).
NUMPY_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"), "I8": np.dtype("<i1"), "U16": np.dtype("<u2"), "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(jnp.bfloat16),
}
# Every dtype safetensors knows, by its bits per element (only to name a malformed entry in a message).
_DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
               "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
               "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
# safetensors' limit on a header's length.
_MAX_HEADER_BYTES = 100_000_000
# A layer index has at most this many digits (every int64 of fewer digits is a layer number).
_MAX_LAYER_DIGITS = 18


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: its name, safetensors dtype name ("BF16"), shape and file."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    path: Path

    @property
    def dtype(self) -> np.dtype | None:
        """The numpy dtype it reads as, or None for a dtype safetensors' numpy reader does not return."""
        return NUMPY_DTYPES.get(self.dtype_name)

    @property
    def dtype_label(self) -> str:
        """The dtype as a numpy name ("bfloat16"), or the stored name ("F8_E4M3") when it reads as none."""
        return self.dtype_name if self.dtype is None else self.dtype.name


class Checkpoint:
    """A safetensors checkpoint opened for reading: its tensor names, where each lies, and block reads.

    Each shard is opened (by safetensors, which checks its header and maps it) when a tensor of it is
    first asked for, and stays open while the Checkpoint lives; a read copies only its block.

    Args:
      path: a directory with ``model.safetensors.index.json``, a directory with ``model.safetensors``,
        or a ``.safetensors`` file.

    Raises:
      ValueError: when ``path`` is none of them (or empty), the index is malformed or names a shard
        outside the directory, or a file safetensors refuses; when a tensor's layer index is not
        written as one, or decoder layers sit under two prefixes.
    """

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"checkpoint: expected a directory with {INDEX_FILE} or {SINGLE_FILE}, or a "
                             f".safetensors file, got {path!r}")
        path = Path(path)
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
        self.layers_prefix = _layers_prefix(self._files)
        self._layers = _layer_names(self._files, self.layers_prefix)

    @property
    def names(self) -> tuple[str, ...]:
        """Every tensor name in the checkpoint (vision tensors included), in stored order."""
        return tuple(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    @property
    def layers(self) -> tuple[int, ...]:
        """The decoder layers the checkpoint holds tensors for, in order."""
        return tuple(sorted(self._layers))

    def layer_prefix(self, layer: int) -> str:
        """The names' prefix of decoder layer ``layer``: ``layers_prefix`` and N ("model.layers.5.")."""
        return f"{self.layers_prefix}{layer}."

    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose tensors include a ``block_sparse_moe`` block."""
        return tuple(layer for layer in self.layers if _has_block(self._layers[layer], self.layer_prefix(layer)))

    def moe_block(self, layer: int) -> str:
        """The names' prefix of layer ``layer``'s MoE block ("...layers.N.block_sparse_moe.").

        Raises:
          ValueError: naming the layer when it is not an integer >= 0, is past the last layer, has no
            tensors, or is a dense layer.
        """
        layer = check_int("layer", layer, minimum=0)
        layers = self.layers
        if layer not in self._layers:
            if not layers or layer > layers[-1]:
                last = f"layers 0..{layers[-1]}" if layers else "no decoder layers"
                raise ValueError(f"layer {layer}: past the last layer: the checkpoint has {last}")
            raise ValueError(f"layer {layer}: the checkpoint has no tensors under {self.layer_prefix(layer)!r}")
        if not _has_block(self._layers[layer], self.layer_prefix(layer)):
            raise ValueError(f"layer {layer}: a dense layer (its feed-forward block is {DENSE_BLOCK!r}, not "
                             f"{MOE_BLOCK!r}): it has no latent MoE tail; the MoE layers here are "
                             f"{_ranges(self.moe_layers())}")
        return f"{self.layer_prefix(layer)}{MOE_BLOCK}."

    def info(self, name: str) -> TensorInfo:
        """Tensor ``name``'s dtype, shape and file (opening the file). ValueError when the checkpoint has no
        such tensor, its file is refused, or the index maps it to a file that lacks it."""
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
        """:meth:`info` of ``name``, checked against what the config expects.

        Args:
          name: the tensor's name.
          shape: its expected shape.
          dtype: one accepted dtype or a tuple of them.
          layer: the decoder layer, for the message.
          what: what the tensor is, for the message.
          dtype_source: where ``dtype`` comes from, for the message.

        Returns:
          The tensor's :class:`TensorInfo`.

        Raises:
          ValueError: naming ``layer``, the tensor and what was expected, when it is missing (named as
            stored quantised when ``X.weight_packed``, ``X.weight_scale``, ... stand in its place) or has
            another shape or dtype.
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
        if info.shape != shape or info.dtype not in dtypes:
            raise ValueError(f"layer {layer}: {name}: expected {wanted}, got shape {info.shape} of "
                             f"{info.dtype_label}")
        return info

    def read(self, name: str, index: Sequence[slice] = ()) -> np.ndarray:
        """Block ``index`` of tensor ``name``, in its stored dtype: safetensors' ``get_slice(name)[index]``,
        which copies only the block's bytes (a block of rows is one run of them).

        Args:
          name: the tensor's name.
          index: one slice of step 1 per leading axis; missing axes are whole.

        Raises:
          ValueError: for a missing tensor, a dtype safetensors' numpy reader does not return (FP8, FP4),
            a bad index, or a file that changed since it was opened.
        """
        info = self.info(name)
        if info.dtype is None:
            raise ValueError(f"{name}: stored as {info.dtype_name}, which safetensors' numpy reader does not "
                             f"return (numpy has no such type); this reader reads {', '.join(NUMPY_DTYPES)}")
        index = _full_index(name, index, info.shape)
        block_shape = tuple(axis.stop - axis.start for axis in index)
        if info.shape and math.prod(block_shape) == 0:
            return np.zeros(block_shape, info.dtype)  # no bytes to read (safetensors refuses some empty slices)
        shard = self._shard(info.path)
        shard.check_unchanged(name)
        try:
            return shard.handle.get_slice(name)[index]
        except SafetensorError as error:
            raise ValueError(f"checkpoint: {str(info.path)!r}: {name}: safetensors cannot read {index}: "
                             f"{error}") from None

    def read_transposed(self, name: str, index: Sequence[slice] = ()) -> np.ndarray:
        """Block ``index`` [rows, columns] of the transpose of the 2-d tensor ``name``: a torch Linear's
        [out, in] weight read as the Flax kernel [in, out] (y = x @ W), reading only the block."""
        info = self.info(name)
        if len(info.shape) != 2:
            raise ValueError(f"{name}: expected a 2-d tensor, got shape {info.shape}")
        rows, columns = _full_index(name, index, info.shape[::-1])
        return np.ascontiguousarray(self.read(name, (columns, rows)).T)

    def _shard(self, path: Path) -> _Shard:
        if path not in self._shards:
            self._shards[path] = _Shard(path)
        return self._shards[path]


def open_checkpoint(checkpoint: str | os.PathLike | Checkpoint) -> Checkpoint:
    """``checkpoint`` when it already is a :class:`Checkpoint`, else the checkpoint at that path."""
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)


def load_tail_weights(
    checkpoint: str | os.PathLike | Checkpoint,
    layer: int,
    *,
    config: TailConfig,
    mesh: Mesh,
    axis_name: AxisName = "tp",
    weight_layout: str = "column",
) -> tuple[jax.Array | None, jax.Array | QuantizedKernel]:
    """The tail's weights of decoder layer ``layer`` of ``checkpoint``, placed on ``mesh``.

    Each device block is read by its own ``jax.make_array_from_callback`` callback, so each device
    reads only its block of the kernel.

    Args:
      checkpoint: a checkpoint path (module docstring) or an opened :class:`Checkpoint`, to load many
        layers from one parse of its index.
      layer: the decoder layer, a MoE one.
      config: the tail's :class:`k3_tail.TailConfig` (e.g. ``TailConfig.from_hf_config(directory)``):
        H, L, ``use_latent_norm``, ``dtype`` and ``up_proj_dtype`` say what the tensors must be and how
        the kernel is stored.
      mesh: the Mesh to place the weights on.
      axis_name: the TP axis.
      weight_layout: "column": the kernel stored [L, padded_hidden_size(H, p)] with zero padding
        columns, sharded ``P(None, axis_name)``. "replicated": [L, H] on every device (``P()``).

    Returns:
      ``(norm_weight, up_proj_kernel)`` for :func:`k3_tail.latent_moe_tail`, :func:`k3_tail.tail_forward`
      or :class:`k3_tail.LatentMoETail`: norm_weight [L] of ``config.dtype``, replicated, or None when
      ``config.use_latent_norm`` is False; up_proj_kernel the transpose [L, H] of the stored [H, L]
      weight in the layout's shape, or with an FP8 ``config.up_proj_dtype`` a
      :class:`k3_tail.QuantizedKernel`, each block quantised as :func:`k3_tail.quantize_up_proj` does
      (padding columns' values and scales zero).

    Raises:
      ValueError: naming the layer and the tensor, for a dense layer, a layer past the last, a missing
        tensor, another shape or dtype than the config's, a norm weight present while
        ``use_latent_norm`` is False, or non-finite values in a kernel to quantise; naming the
        argument for a bad config, mesh, axis or layout.
    """
    check_config(config)
    axis_name = check_axis_name(axis_name)
    tp_size = check_mesh(mesh, axis_name)
    weight_layout = check_weight_layout(weight_layout)
    checkpoint = open_checkpoint(checkpoint)
    block = checkpoint.moe_block(layer)
    hidden, latent, dtype = config.hidden_size, config.latent_size, config.dtype
    up_name, norm_name = block + UP_PROJ, block + NORM
    checkpoint.expect(up_name, (hidden, latent), dtype, layer=layer,
                      what=f"[H, L] = [{hidden}, {latent}]: torch's [out, in] of the up projection")
    norm_weight = None
    if config.use_latent_norm:
        checkpoint.expect(norm_name, (latent,), dtype, layer=layer, what=f"[L] = [{latent}]: the latent RMSNorm scale")
        norm_weight = jax.make_array_from_callback((latent,), NamedSharding(mesh, P()),
                                                   lambda index: checkpoint.read(norm_name, index))
    elif norm_name in checkpoint:
        raise ValueError(f"layer {layer}: {norm_name}: the checkpoint has the latent norm's scale but "
                         "config.use_latent_norm is False (latent_moe_use_norm in the model's config)")
    kernel = _up_projection(checkpoint, up_name, layer=layer, config=config, mesh=mesh,
                            columns=axis_name if weight_layout == "column" else None, tp_size=tp_size)
    return norm_weight, kernel


def _up_projection(checkpoint: Checkpoint, name: str, *, layer: int, config: TailConfig, mesh: Mesh,
                   columns: AxisName | None, tp_size: int) -> jax.Array | QuantizedKernel:
    """The kernel [L, width] from the stored [H, L] weight, each device's block read (and quantised)
    by its own callback; sharded by columns over ``columns``, or replicated when that is None."""
    hidden, latent = config.hidden_size, config.latent_size
    width = hidden if columns is None else padded_hidden_size(hidden, tp_size)
    values_sharding = NamedSharding(mesh, P() if columns is None else P(None, columns))
    fp8 = config.up_proj_dtype
    scales: dict[tuple[int, int], np.ndarray] = {}

    def real_columns(start: int, stop: int) -> np.ndarray:
        """Columns [start, stop) of the kernel that are not padding: [L, n] (nothing read when n = 0)."""
        stop = min(stop, hidden)
        if stop <= start:
            return np.zeros((latent, 0), config.dtype)
        return checkpoint.read_transposed(name, (slice(None), slice(start, stop)))

    def values_block(index) -> np.ndarray:
        start, stop, _ = index[1].indices(width)
        real = real_columns(start, stop)
        values = np.zeros((latent, stop - start), config.dtype if fp8 is None else fp8)
        if fp8 is None:
            values[:, :real.shape[1]] = real
            return values
        scale = np.zeros(stop - start, np.float32)
        if real.shape[1]:
            try:
                quantized = quantize_up_proj(real, fp8)
            except ValueError as error:
                raise ValueError(f"layer {layer}: {name}: {error}") from None
            values[:, :real.shape[1]] = np.asarray(quantized.values)
            scale[:real.shape[1]] = np.asarray(quantized.scale)
        scales[(start, stop)] = scale
        return values

    values = jax.make_array_from_callback((latent, width), values_sharding, values_block)
    if fp8 is None:
        return values

    def scale_block(index) -> np.ndarray:
        start, stop, _ = index[0].indices(width)
        if (start, stop) not in scales:  # every values block was read above; only a differing split lands here
            values_block((slice(None), slice(start, stop)))
        return scales[(start, stop)]

    scale_sharding = NamedSharding(mesh, P() if columns is None else P(columns))
    return QuantizedKernel(values, jax.make_array_from_callback((width,), scale_sharding, scale_block))


def sharded_array(shape: Sequence[int], sharding: NamedSharding, read_block: Callable[[tuple[slice, ...]], np.ndarray],
                  dtype: Any) -> jax.Array:
    """``jax.make_array_from_callback`` with the index made explicit, for reading other tensors.

    Args:
      shape: the global shape.
      sharding: where the blocks go.
      read_block: called with each device's index (one slice per axis, steps 1, bounds resolved);
        returns that block.
      dtype: the array's dtype; a block of another dtype is cast to it.

    Returns:
      The global array.
    """
    shape = tuple(shape)
    dtype = np.dtype(dtype)

    def block(index):
        resolved = tuple(slice(*axis.indices(size)[:2]) for axis, size in zip(index, shape, strict=True))
        value = read_block(resolved)
        return value if value.dtype == dtype else value.astype(dtype)

    return jax.make_array_from_callback(shape, sharding, block, dtype=dtype)


class _Shard:
    """One safetensors file as safetensors opened it (header checked, file mapped), and which file it was
    then (device, inode, size, modification time), so that a file changed since is refused before a read
    touches its map."""

    def __init__(self, path: Path):
        self.path = path
        identity = _identity(path)
        try:
            self.handle = safe_open(path, framework="numpy")
        except (SafetensorError, OSError) as error:
            tensor = _malformed_entry(path)
            raise ValueError(f"checkpoint: {str(path)!r}: {f'{tensor}: ' if tensor else ''}safetensors refuses the "
                             f"file ({error})") from None
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


def _malformed_entry(path: Path) -> str | None:
    """For the message when safetensors refused ``path`` (it names a tensor only for bad tiling): the first
    tensor, in header order, whose own entry breaks the format (dtype a known name; shape and the two
    data_offsets non-negative integers, in order; the bytes those hold). None when no entry does or the
    header does not parse. Decides nothing: safetensors has refused the file already."""
    try:
        with open(path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(min(length, _MAX_HEADER_BYTES)), object_pairs_hook=tuple)
    except (OSError, ValueError, RecursionError):
        return None
    for name, entry in header if isinstance(header, tuple) else ():  # an object's (key, value) pairs
        fields = dict(entry) if isinstance(entry, tuple) else {}
        dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        if name == "__metadata__":
            continue
        if (dtype not in _DTYPE_BITS or not _counts(shape) or not _counts(offsets) or len(offsets) != 2
                or offsets[1] < offsets[0] or (offsets[1] - offsets[0]) * 8 != math.prod(shape) * _DTYPE_BITS[dtype]):
            return name
    return None


def _counts(value: Any) -> bool:
    """Whether ``value`` is a JSON list of non-negative integers."""
    return isinstance(value, list) and all(type(item) is int and item >= 0 for item in value)


def _identity(path: Path) -> tuple[int, int, int, int]:
    """(device, inode, size, modification time) of the regular file ``path``; ValueError when it is
    missing, unreadable or not a regular file (safetensors would wait forever on a FIFO)."""
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
    """tensor name -> shard file, from a ``model.safetensors.index.json``; each shard a plain file name in
    the index's directory."""
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
    if not isinstance(shard, str):
        raise ValueError(f"checkpoint: {str(index)!r}: weight_map.{name}: expected a shard's file name, got {shard!r}")
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if shard in ("", ".", "..") or any(separator in shard for separator in separators) or "\0" in shard:
        raise ValueError(f"checkpoint: {str(index)!r}: weight_map.{name}: {shard!r} is not a plain file name; a "
                         "shard must be a file in the checkpoint's own directory (absolute paths, path "
                         "separators and '..' are refused)")
    return shard


def _layers_prefix(names: Mapping[str, Any]) -> str:
    """The one of LAYER_PREFIXES the checkpoint's decoder layers sit under; ValueError for none or several."""
    found = [prefix for prefix in LAYER_PREFIXES if any(name.startswith(prefix) for name in names)]
    if not found:
        named = " or ".join(f"{prefix}N.*" for prefix in LAYER_PREFIXES)
        raise ValueError(f"checkpoint: no decoder layers: no tensor named {named}")
    if len(found) > 1:
        raise ValueError(f"checkpoint: decoder layers under {' and '.join(found)}: which are the text model's is "
                         "ambiguous")
    return found[0]


def _layer_names(names: Mapping[str, Any], prefix: str) -> dict[int, list[str]]:
    """layer -> the names under ``prefix`` N.; ValueError naming a tensor whose N is not a layer index
    written as Hugging Face writes one (decimal digits, no leading zero)."""
    layers: dict[int, list[str]] = {}
    for name in names:
        if not name.startswith(prefix):
            continue
        number, dot, _ = name[len(prefix):].partition(".")
        canonical = number.isascii() and number.isdigit() and (number == "0" or not number.startswith("0"))
        if not dot or not canonical or len(number) > _MAX_LAYER_DIGITS:
            raise ValueError(f"checkpoint: {name}: {prefix}{number}{dot} is no decoder layer: a layer index is "
                             f"written in decimal without leading zeros ({prefix}1.), of at most "
                             f"{_MAX_LAYER_DIGITS} digits")
        layers.setdefault(int(number), []).append(name)
    return layers


def _has_block(names: Sequence[str], layer_prefix: str) -> bool:
    return any(name.startswith(f"{layer_prefix}{MOE_BLOCK}.") for name in names)


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


def _ranges(layers: Sequence[int]) -> str:
    """"1..5, 7" for layers 1, 2, 3, 4, 5, 7 ("none" when empty)."""
    if not layers:
        return "none"
    runs, first, last = [], layers[0], layers[0]
    for layer in layers[1:]:
        if layer == last + 1:
            last = layer
            continue
        runs.append((first, last))
        first = last = layer
    runs.append((first, last))
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)
