"""The tail's weights from a Hugging Face checkpoint, read so that each device reads only its own block.

A checkpoint is a directory with ``model.safetensors.index.json`` (its ``weight_map`` names each
tensor's shard), a directory with one ``model.safetensors``, or one ``.safetensors`` file. Kimi-K3 keeps
its text model under ``language_model.`` (beside the vision tower); other models of the family store it
unprefixed. A MoE layer's block is ``block_sparse_moe`` (a dense layer's is ``mlp``), holding

    block_sparse_moe.routed_expert_up_proj.weight   [H, L]  torch's [out, in]: the kernel W [L, H] transposed
    block_sparse_moe.routed_expert_norm.weight      [L]     the RMSNorm scale g (with latent_moe_use_norm)

Column k of the kernel is row k of the stored tensor, so a column block [L, Hb] is one contiguous run of
stored rows: each device maps exactly those bytes and the whole kernel is never in one place (on
Kimi-K3 at p = 8: 6.4 MB per device instead of 51 MB). An FP8 kernel is quantised block by block as
it is read, since a column's scale needs only that column. The safetensors format (an 8-byte
little-endian header length, a JSON header, raw little-endian data) is read here with numpy memory
maps, so no other package is needed. A tensor of another shape or dtype than the config says is
refused, never cast; one stored quantised (compressed-tensors' ``weight_packed``) is named as such.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3_tail._checks import AxisName, check_axis_name, check_int, check_mesh
from k3_tail.config import TailConfig, check_config
from k3_tail.ops.columns import check_weight_layout, padded_hidden_size
from k3_tail.ops.up_projection import QuantizedKernel, quantize_up_proj

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Kimi-K3's multimodal wrapper puts the text model's tensors under this prefix.
WRAPPER_PREFIX = "language_model."
LAYERS = "model.layers."
MOE_BLOCK, DENSE_BLOCK = "block_sparse_moe", "mlp"
UP_PROJ, NORM = "routed_expert_up_proj.weight", "routed_expert_norm.weight"

# safetensors' dtype names -> numpy dtypes (little-endian, as the format stores them).
SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"), "I8": np.dtype("<i1"), "U16": np.dtype("<u2"), "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(jnp.bfloat16),
    "F8_E4M3": np.dtype(jnp.float8_e4m3fn), "F8_E5M2": np.dtype(jnp.float8_e5m2),
}
_HEADER_LENGTH_BYTES = 8
# A header larger than this is not a safetensors header (the format's own limit is 100 MB).
_MAX_HEADER_BYTES = 100_000_000


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lies: its name, safetensors dtype name ("BF16"), shape, file and the
    byte offset of its data in that file."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    path: Path
    offset: int

    @property
    def dtype(self) -> np.dtype | None:
        """The numpy dtype of the stored values, or None for a dtype this reader does not know."""
        return SAFETENSORS_DTYPES.get(self.dtype_name)

    @property
    def dtype_label(self) -> str:
        """The dtype as a numpy name ("bfloat16"), or the stored name when numpy has none."""
        return self.dtype_name if self.dtype is None else self.dtype.name


class Checkpoint:
    """A safetensors checkpoint opened for reading: its tensor names, where each lies, and block reads.

    Holds no open file: each read maps the bytes it needs and copies them.

    Args:
      path: a directory with ``model.safetensors.index.json``, a directory with ``model.safetensors``,
        or a ``.safetensors`` file.

    Raises:
      ValueError: when ``path`` is none of them, or an index or header is malformed.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.path = path
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        if path.is_dir() and (path / INDEX_FILE).is_file():
            self._files = _read_index(path / INDEX_FILE)
        elif path.is_dir() and (path / SINGLE_FILE).is_file():
            self._files = dict.fromkeys(self._header(path / SINGLE_FILE), path / SINGLE_FILE)
        elif path.is_file():
            self._files = dict.fromkeys(self._header(path), path)
        else:
            raise ValueError(f"checkpoint: expected a directory with {INDEX_FILE} or {SINGLE_FILE}, or a "
                             f".safetensors file, got {str(path)!r}")
        self.prefix = _text_prefix(self._files)
        pattern = re.compile(rf"^{re.escape(self.prefix + LAYERS)}(\d+)\.")
        self._layers: dict[int, list[str]] = {}
        for name in self._files:
            match = pattern.match(name)
            if match:
                self._layers.setdefault(int(match.group(1)), []).append(name)

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
        """The names' prefix of decoder layer ``layer``: "language_model.model.layers.N." or "model.layers.N."."""
        return f"{self.prefix}{LAYERS}{layer}."

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
        """Where tensor ``name`` lies; ValueError when the checkpoint has no such tensor."""
        if name not in self._files:
            raise ValueError(f"{name}: missing from the checkpoint")
        return self._header(self._files[name])[name]

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
        """A copy of block ``index`` of tensor ``name``, in its stored dtype; maps only the stored rows
        the block spans, so a block of rows reads exactly its bytes.

        Args:
          name: the tensor's name.
          index: one slice of step 1 per leading axis; missing axes are whole.

        Raises:
          ValueError: for a missing tensor, a dtype this reader does not know, or a bad index.
        """
        info = self.info(name)
        if info.dtype is None:
            raise ValueError(f"{name}: stored as {info.dtype_name}, a dtype this reader does not know "
                             f"(it knows {', '.join(SAFETENSORS_DTYPES)})")
        index = _full_index(name, index, info.shape)
        if not info.shape:
            return np.fromfile(info.path, info.dtype, count=1, offset=info.offset).reshape(())
        start, stop = index[0].start, index[0].stop
        rows = (stop - start,) + info.shape[1:]
        if math.prod(rows) == 0:
            return np.zeros(rows, info.dtype)[(slice(None),) + index[1:]]
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        mapped = np.memmap(info.path, info.dtype, mode="r", offset=info.offset + start * row_bytes, shape=rows)
        block = np.array(mapped[(slice(None),) + index[1:]])
        del mapped  # unmapped now: a block is all that stays
        return block

    def read_transposed(self, name: str, index: Sequence[slice] = ()) -> np.ndarray:
        """Block ``index`` [rows, columns] of the transpose of the 2-d tensor ``name``: a torch Linear's
        [out, in] weight read as the Flax kernel [in, out] (y = x @ W), reading only the block."""
        info = self.info(name)
        if len(info.shape) != 2:
            raise ValueError(f"{name}: expected a 2-d tensor, got shape {info.shape}")
        rows, columns = _full_index(name, index, info.shape[::-1])
        return np.ascontiguousarray(self.read(name, (columns, rows)).T)

    def _header(self, path: Path) -> dict[str, TensorInfo]:
        if path not in self._headers:
            self._headers[path] = _read_header(path)
        return self._headers[path]


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


def _read_index(path: Path) -> dict[str, Path]:
    """tensor name -> shard file, from a ``model.safetensors.index.json``."""
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"checkpoint: {str(path)!r} is not JSON ({error})") from None
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if not isinstance(weight_map, Mapping) or not all(
            isinstance(name, str) and isinstance(shard, str) for name, shard in weight_map.items()):
        raise ValueError(f"checkpoint: {str(path)!r} has no weight_map of tensor names to shard files")
    return {name: path.parent / shard for name, shard in weight_map.items()}


def _read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of the safetensors file at ``path``, from its header. ValueError when it is not one."""
    if not path.is_file():
        raise ValueError(f"checkpoint: the shard {str(path)!r} is missing")
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(_HEADER_LENGTH_BYTES)
        length = int.from_bytes(prefix, "little") if len(prefix) == _HEADER_LENGTH_BYTES else -1
        if not 0 < length <= min(_MAX_HEADER_BYTES, size - _HEADER_LENGTH_BYTES):
            raise ValueError(f"checkpoint: {str(path)!r} is not a safetensors file (no header)")
        try:
            header = json.loads(file.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"checkpoint: {str(path)!r}: its safetensors header is not JSON ({error})") from None
    if not isinstance(header, Mapping):
        raise ValueError(f"checkpoint: {str(path)!r}: its safetensors header is not a JSON object")
    data_start = _HEADER_LENGTH_BYTES + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape = entry["dtype"], tuple(entry["shape"])
            begin, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"checkpoint: {str(path)!r}: {name}: a malformed header entry {entry!r}") from None
        info = TensorInfo(name, dtype_name, shape, path, data_start + begin)
        dtype = info.dtype
        if dtype is not None and (end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size):
            raise ValueError(f"checkpoint: {str(path)!r}: {name}: its byte range [{begin}, {end}) does not hold "
                             f"shape {shape} of {dtype.name} within the file")
        tensors[name] = info
    return tensors


def _text_prefix(names: Mapping[str, Any]) -> str:
    """"language_model." when the text model's layers are stored under Kimi-K3's wrapper, else ""."""
    if any(name.startswith(WRAPPER_PREFIX + LAYERS) for name in names):
        return WRAPPER_PREFIX
    if any(name.startswith(LAYERS) for name in names):
        return ""
    raise ValueError(f"checkpoint: no decoder layers: no tensor named {LAYERS}N.* or {WRAPPER_PREFIX}{LAYERS}N.*")


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
