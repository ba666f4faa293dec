"""The up projection's weights and its GEMM: the kernel in ``config.dtype`` or quantised to FP8.

At decode the tail is bound by reading the [L, H] kernel (51 MB in bf16 at Kimi-K3's shapes, 6.4 MB
per rank when column-sharded). :func:`quantize_up_proj` stores it in an 8-bit float format with one
float32 scale per output column, which halves those bytes:

    W ~= values * scale        values: FP8 [L, H], scale: float32 [H] = amax(|W[:, j]|) / max of the format

Per-column scales keep one loud output channel from costing the others their precision. Formats:
"float8_e4m3fn" (OCP E4M3: MI355X/gfx950, H100/H200) and "float8_e4m3fnuz" (MI300X/MI325X, gfx942;
no infinity and no negative zero, largest value 240, where E4M3FN reaches 448).
:func:`native_fp8_format` names the one a device multiplies (``quantize_up_proj(kernel, device=...)``).

:func:`project` is the GEMM of every tier. With a :class:`QuantizedKernel` it multiplies by the FP8
values converted to the activation's dtype inside the program (XLA's GPU backend fuses the
conversion into the GEMM, which then reads the FP8 kernel: no copy of the kernel in another dtype)
and scales the float32 result per column. With ``fp8_activations`` the activation rows are also
quantised, per token, to the same format, and the GEMM takes two FP8 operands with float32
accumulation; each row's scale is applied to the result with the column scales. That is an FP8 GEMM
only in a format the GPU multiplies: XLA converts two operands of the other format to float16 for the
GEMM (FP8 bytes, the f16 rate), so :func:`check_fp8_activations` refuses that combination where the
tail is traced (:func:`k3_tail.latent_moe_tail`'s device). Weight-only FP8 runs in ``config.dtype``
and takes either format everywhere.

:func:`outside_gemm` keeps a GEMM's result from being added to anything inside the GEMM on ROCm (no
hipBLASLt GEMM that accumulates into a C operand: docs/design.md, "No C-accumulating GEMM on ROCm").

A :class:`QuantizedKernel` is a pytree whose leaves both have the kernel's columns as their last
axis, so every column operation (padding, a rank's block, a column sharding) applies to them alike:
:func:`map_columns`, :func:`column_spec` and :func:`column_sharding`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3_tail._checks import describe, expect_array
from k3_tail.hardware import FP8_ARCHITECTURES, device_platform, native_fp8_formats
from k3_tail.ops.scopes import UP_PROJECTION

FP8_FORMATS = ("float8_e4m3fn", "float8_e4m3fnuz")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKernel:
    """An up-projection kernel in FP8 with one float32 scale per output column (a JAX pytree).

    values: FP8 [L, N] (N = H, or a rank's column block); scale: float32 [N]. The kernel it stands
    for is ``values * scale`` (:meth:`dequantize`). Made by :func:`quantize_up_proj`; the tail takes
    it wherever it takes a kernel, when ``TailConfig.up_proj_dtype`` is its format.
    """

    values: Any
    scale: Any

    @property
    def shape(self) -> tuple[int, ...]:
        """The kernel's shape [L, N] (that of ``values``)."""
        return tuple(self.values.shape)

    @property
    def dtype(self) -> np.dtype:
        """The FP8 format of ``values``."""
        return np.dtype(self.values.dtype)

    def dequantize(self) -> jax.Array:
        """``values * scale`` in float32, [L, N]: the kernel the quantised GEMM computes with."""
        return jnp.asarray(self.values, jnp.float32) * jnp.asarray(self.scale, jnp.float32)


def fp8_format(value: Any, argument: str) -> np.dtype:
    """``value`` (a name such as "float8_e4m3fn" or a dtype) as one of :data:`FP8_FORMATS`, or
    ValueError naming ``argument``."""
    try:
        dtype = None if value is None else np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in FP8_FORMATS:
        raise ValueError(f"{argument}: expected one of {FP8_FORMATS} (a name or a jnp dtype), got {value!r}")
    return dtype


# The GPU platforms on which FP8 activations are checked against the formats the device multiplies.
# Elsewhere (the CPU backend) there are no FP8 matrix units to miss: XLA:CPU computes an FP8 x FP8
# product in float32 whatever the format, so both formats are taken, with the same numerics.
_FP8_CHECKED_PLATFORMS = ("rocm", "cuda")
# The format for a device without FP8 matrix units (the CPU): OCP's, which has the larger range.
_DEFAULT_FP8_FORMAT = "float8_e4m3fn"


def native_fp8_format(device: Any) -> str:
    """The FP8 format (dtype name) to store the up projection in for ``device`` (a ``jax.Device``):
    the one its GPU multiplies natively ("float8_e4m3fnuz" on MI300X / MI325X, gfx942;
    "float8_e4m3fn" on MI355X, gfx950, and H100 / H200), from the hardware presets' ``fp8_formats``
    (:func:`k3_tail.hardware.native_fp8_formats`). A CPU device multiplies neither natively
    (it computes in float32): "float8_e4m3fn". A GPU whose device kind is not known there is a
    ValueError naming it."""
    platform = device_platform(device)
    if platform not in _FP8_CHECKED_PLATFORMS:
        return _DEFAULT_FP8_FORMAT
    formats = native_fp8_formats(device.device_kind)
    if not formats:
        raise ValueError(
            f"device: k3_tail does not know which FP8 format the device {device.device_kind!r} ({platform}) "
            f"multiplies natively (it knows {_known_architectures()}); name the format: quantize_up_proj(kernel, dtype)"
        )
    return formats[0]


def check_fp8_activations(up_proj_dtype: np.dtype | None, fp8_activations: bool, device: Any) -> None:
    """ValueError when an FP8 GEMM with ``fp8_activations`` in format ``up_proj_dtype`` would not be one on
    ``device`` (a ``jax.Device`` of the mesh the tail is traced for).

    On a GPU whose matrix units multiply another format (E4M3FN on MI300X, which multiplies E4M3FNUZ;
    E4M3FNUZ on MI355X, H100 and H200, which multiply E4M3FN), XLA converts both FP8 operands to
    float16 for the GEMM (inside its fusion on ROCm, in fusions before a cuBLASLt call on H100): FP8
    bytes at the f16 rate, which nothing would say. The message names
    the format, the device kind and the format it multiplies. So does a GPU whose device kind is not
    known (:func:`k3_tail.hardware.native_fp8_formats`): the format cannot be vouched for there.
    Weight-only FP8 (``fp8_activations`` False) multiplies in the activation dtype and takes either
    format anywhere; on the CPU (no FP8 matrix units: XLA:CPU computes in float32) both are taken.
    """
    if not fp8_activations or up_proj_dtype is None:
        return
    platform = device_platform(device)
    if platform not in _FP8_CHECKED_PLATFORMS:
        return
    name = np.dtype(up_proj_dtype).name
    kind = device.device_kind
    formats = native_fp8_formats(kind)
    weight_only = "or keep this kernel with weight-only FP8 (fp8_activations=False), which takes either format"
    if formats is None:
        raise ValueError(
            f"config.up_proj_dtype: {name} with fp8_activations=True on the device {kind!r} ({platform}), whose FP8 "
            f"format k3_tail does not know (it knows {_known_architectures()}): an FP8 GEMM in a format the GPU "
            f"does not multiply would run converted to float16, at the f16 rate; {weight_only}"
        )
    if name not in formats:
        native = " or ".join(formats)
        raise ValueError(
            f"config.up_proj_dtype: {name} with fp8_activations=True, but the device {kind!r} ({platform}) multiplies "
            f"{native} natively: XLA would convert both GEMM operands to float16 and run the FP8 GEMM at the f16 "
            f"rate. Quantise the kernel to {formats[0]} (k3_tail.quantize_up_proj(kernel, device=device)) with "
            f"TailConfig(up_proj_dtype={formats[0]!r}), {weight_only}"
        )


def _known_architectures() -> str:
    return ", ".join("/".join(name.upper() for name in names) for names in FP8_ARCHITECTURES)


def quantize_up_proj(kernel: Any, dtype: Any = None, *, device: Any = None) -> QuantizedKernel:
    """The [L, H] up-projection ``kernel`` quantised to FP8 ``dtype`` with per-column scales.

    kernel: a float array [L, H] (numpy or jax, any float dtype; a checkpoint's bf16 kernel).
    dtype: "float8_e4m3fn" or "float8_e4m3fnuz" (or the jnp dtype); None: the format ``device``
      multiplies natively (:func:`native_fp8_format`), which FP8 activations need there.
    device: a ``jax.Device`` of the mesh the tail runs on, when ``dtype`` is None (exactly one of
      the two is given). The result's ``dtype.name`` is the ``TailConfig.up_proj_dtype`` to use.
    Returns ``QuantizedKernel(values, scale)``: scale[j] = amax(|kernel[:, j]|) / max of the format
    (1 for an all-zero column, whose values are zeros), values = kernel / scale rounded to the format,
    clipped to its range first (a cast beyond the range of E4M3FNUZ, which has no infinity, is NaN).
    Computed in float32; each value is off by at most half a unit in the last place of the format
    (3 mantissa bits: a relative error <= 2^-4), or the format's subnormal spacing times the scale.
    A kernel with a non-finite value is a ValueError when it is concrete; under ``jax.jit`` it cannot
    be inspected, and its column's scale becomes non-finite.
    """
    if dtype is None and device is None:
        raise ValueError(f"dtype: expected one of {FP8_FORMATS} (a name or a jnp dtype), or device=<a jax.Device> "
                         f"for the format it multiplies natively; got neither")
    if dtype is not None and device is not None:
        raise ValueError(f"device: expected only without dtype (it picks the format), got dtype={dtype!r} as well")
    fp8 = fp8_format(native_fp8_format(device) if dtype is None else dtype, "dtype")
    if (not hasattr(kernel, "shape") or not hasattr(kernel, "dtype") or len(kernel.shape) != 2
            or not jnp.issubdtype(kernel.dtype, jnp.floating) or 0 in kernel.shape):
        raise ValueError(f"kernel: expected a non-empty 2-d float array [L, H], got {describe(kernel)}")
    if not isinstance(kernel, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(kernel))):
        raise ValueError("kernel: expected finite values, got NaN or infinity")
    return _quantize_columns(kernel, fp8)


@functools.partial(jax.jit, static_argnums=1)
def _quantize_columns(kernel: jax.Array, fp8: np.dtype) -> QuantizedKernel:
    kernel = kernel.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(kernel), axis=0), fp8)
    return QuantizedKernel(_round_to(kernel / scale, fp8), scale)


def _scale(amax: jax.Array, fp8: np.dtype) -> jax.Array:
    """amax / the format's largest value; 1 where amax is 0 (those values are all zero)."""
    scale = amax / float(jnp.finfo(fp8).max)
    return jnp.where(scale > 0, scale, 1.0)


def _round_to(x: jax.Array, fp8: np.dtype) -> jax.Array:
    """float32 ``x`` rounded to ``fp8``, clipped to its range first (never NaN for a finite x)."""
    largest = float(jnp.finfo(fp8).max)
    return jnp.clip(x, -largest, largest).astype(fp8)


def project(latent: jax.Array, kernel: jax.Array | QuantizedKernel, *, fp8_activations: bool = False) -> jax.Array:
    """``latent @ kernel``: [T, L] x [L, N] -> float32 [T, N], accumulated in float32.

    A plain kernel: one GEMM of ``latent``'s dtype, 2TLN FLOPs, reading d*L*N kernel bytes.
    A :class:`QuantizedKernel`: the GEMM reads the FP8 values (L*N bytes; the conversion to
    ``latent``'s dtype is fused into it on GPU) and the result is scaled per column (4N bytes).
    ``fp8_activations`` (only with a QuantizedKernel): ``latent`` is first quantised per row to the
    kernel's format (a scale per token: amax / the format's max), so the GEMM multiplies two FP8
    operands; the row and column scales are applied to its float32 result.

    A single row (T = 1, or a rank's one row of a token-sharded call) is multiplied as two, the
    second zero, and the zero row's result dropped: XLA turns a one-row product with a narrow kernel
    into a multiply that writes a float32, transposed copy of the kernel and a reduce that reads it
    back (GPU), or a slower matrix-vector path (CPU); with two rows it stays one GEMM that reads the
    kernel once in its stored dtype (docs/design.md, "One-row GEMMs").
    """
    rows = latent.shape[0]
    with jax.named_scope(UP_PROJECTION):
        padded = jnp.pad(latent, [(0, gemm_rows(rows) - rows), (0, 0)])  # no-op but for one row
        return _project_rows(padded, kernel, fp8_activations=fp8_activations)[:rows]


def gemm_rows(rows: int) -> int:
    """The rows the GEMM of :func:`project` multiplies for ``rows`` latent rows: 2 for one, else ``rows``."""
    return 2 if rows == 1 else rows


def _project_rows(latent: jax.Array, kernel: jax.Array | QuantizedKernel, *, fp8_activations: bool) -> jax.Array:
    """:func:`project` for any number of rows, as one product."""
    if not isinstance(kernel, QuantizedKernel):
        return jnp.dot(latent, kernel, preferred_element_type=jnp.float32)
    if not fp8_activations:
        projected = jnp.dot(latent, kernel.values.astype(latent.dtype), preferred_element_type=jnp.float32)
        return projected * kernel.scale
    fp8 = kernel.dtype
    rows = latent.astype(jnp.float32)
    row_scale = _scale(jnp.max(jnp.abs(rows), axis=1, keepdims=True), fp8)
    projected = jnp.dot(_round_to(rows / row_scale, fp8), kernel.values, preferred_element_type=jnp.float32)
    return projected * row_scale * kernel.scale


def outside_gemm(projected: jax.Array, *, platform: str | None) -> jax.Array:
    """``projected``, a GEMM's result, as a value that XLA cannot add to inside the GEMM on ROCm.

    XLA's GEMM rewriter folds ``dot + x`` into a library GEMM that accumulates into a C operand
    (beta = 1, the output aliased to C: ``__cublas$lt$matmul`` with ``output_to_operand_aliasing``),
    the form vLLM ROCm removed from this tail because hipBLASLt's C-accumulating GEMM faults at some
    row counts (docs/design.md, "No C-accumulating GEMM on ROCm"). On ``platform`` "rocm"
    (:func:`k3_tail.hardware.device_platform`) the result passes an optimisation barrier,
    which the rewriter cannot see through, so the add stays a fusion of its own after the GEMM; the
    barrier emits no kernel. Elsewhere (CUDA keeps its fused form) ``projected`` is returned as is.
    """
    if platform != "rocm":
        return projected
    return lax.optimization_barrier(projected)


def map_columns(function: Callable[[jax.Array], jax.Array], kernel: jax.Array | QuantizedKernel):
    """``function`` applied to the kernel, or to a QuantizedKernel's values and scale alike.

    ``function`` must act on the last (column) axis only: pad columns, take a block of them.
    """
    return jax.tree.map(function, kernel)


def column_spec(kernel: jax.Array | QuantizedKernel | None, axis_name: Any) -> Any:
    """The shard_map / NamedSharding spec of a kernel sharded by columns over ``axis_name``
    (``P(None, axis_name)`` for values, ``P(axis_name)`` for scales), or replicated (``P()``) when
    ``axis_name`` is None: one spec per leaf (a QuantizedKernel of two specs)."""
    values = P() if axis_name is None else P(None, axis_name)
    if isinstance(kernel, QuantizedKernel):
        return QuantizedKernel(values, P() if axis_name is None else P(axis_name))
    return values


def column_sharding(kernel: jax.Array | QuantizedKernel, mesh: Mesh, axis_name: Any) -> Any:
    """:func:`column_spec` as ``NamedSharding`` over ``mesh`` (a pytree of them for a QuantizedKernel),
    for ``jax.device_put``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), column_spec(kernel, axis_name),
                        is_leaf=lambda x: isinstance(x, P))


def check_up_proj_kernel(
    kernel: Any, *, dtype: np.dtype, up_proj_dtype: np.dtype | None, shapes: Sequence[tuple[int, int]], sizes: str
) -> None:
    """ValueError naming ``up_proj_kernel`` unless ``kernel`` is what the config expects.

    ``up_proj_dtype`` None: an array of ``dtype`` with one of ``shapes``. An FP8 format: a
    :class:`QuantizedKernel` of that format whose values have one of ``shapes`` [L, N] and whose
    scale is float32 [N]. ``sizes`` names the sizes the shapes come from, for the message.
    """
    if up_proj_dtype is None:
        if isinstance(kernel, QuantizedKernel):
            raise ValueError(
                f"up_proj_kernel: got a QuantizedKernel ({kernel.dtype.name}) but config.up_proj_dtype is None: "
                f"expected a {dtype.name} array; set TailConfig(up_proj_dtype={kernel.dtype.name!r}) to use it"
            )
        expect_array(kernel, "up_proj_kernel", shapes, dtype, sizes)
        return
    if not isinstance(kernel, QuantizedKernel):
        raise ValueError(
            f"up_proj_kernel: config.up_proj_dtype is {up_proj_dtype.name}, so expected a k3_tail.QuantizedKernel "
            f"(k3_tail.quantize_up_proj(kernel, {up_proj_dtype.name!r})), got {describe(kernel)}"
        )
    expect_array(kernel.values, "up_proj_kernel", shapes, up_proj_dtype, f"values: {sizes}",
                 dtype_field="config.up_proj_dtype")
    expect_array(kernel.scale, "up_proj_kernel", [kernel.values.shape[1:]], np.dtype(np.float32),
                 "scale: one per column", dtype_field="float32 scales")
