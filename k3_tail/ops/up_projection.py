"""The up projection's weights and its GEMM: the kernel in ``config.dtype`` or quantised to FP8.

At decode the tail is bound by reading the [L, H] kernel (51 MB in bf16 at Kimi-K3's shapes), so
:func:`quantize_up_proj` stores it in FP8 with one float32 scale per output column (one loud channel
does not cost the others their precision): W ~= values * scale, scale[j] = amax(|W[:, j]|) / the
format's max. "float8_e4m3fn" is OCP E4M3 (MI355X, H100/H200); "float8_e4m3fnuz" is gfx942's
(MI300X/MI325X: no infinity, no negative zero, largest value 240 where E4M3FN reaches 448).

:func:`project` is every tier's GEMM. A :class:`QuantizedKernel` is converted to the activation's
dtype inside the program (XLA's GPU backend fuses that into the GEMM, which reads the FP8 kernel).
With ``fp8_activations`` the rows are quantised per token too and the GEMM takes two FP8 operands;
that is an FP8 GEMM only in a format the GPU multiplies (XLA converts two operands of the other format
to float16: FP8 bytes at the f16 rate), so :func:`check_fp8_activations` refuses the rest.

A QuantizedKernel's leaves both have the kernel's columns as their last axis, so every column
operation (padding, a rank's block, a column sharding) applies to them alike (:func:`map_columns`).
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail._checks import describe, expect_array
from k3_tail.hardware import FP8_ARCHITECTURES, check_device, device_platform, native_fp8_formats
from k3_tail.ops.scopes import UP_PROJECTION

FP8_FORMATS = ("float8_e4m3fn", "float8_e4m3fnuz")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKernel:
    """An up-projection kernel in FP8 with one float32 scale per output column (a JAX pytree).

    Made by :func:`quantize_up_proj`; the tail takes it wherever it takes a kernel, when
    ``TailConfig.up_proj_dtype`` is its format. The kernel it stands for is ``values * scale``.

    Attributes:
      values: FP8 [L, N] (N = H, or a rank's column block).
      scale: float32 [N].
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
    """The FP8 format (dtype name) ``device``'s GPU multiplies natively, from the hardware presets
    (:func:`k3_tail.hardware.native_fp8_formats`); "float8_e4m3fn" on a CPU, which multiplies neither.
    ValueError naming ``device`` for a GPU whose device kind is not known there."""
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
    """ValueError when FP8 activations in format ``up_proj_dtype`` would not make an FP8 GEMM on
    ``device`` (module docstring): its GPU multiplies another format, or its kind is not known. Weight-only
    FP8 and the CPU (no FP8 matrix units: XLA:CPU computes in float32) take either format."""
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
    """The [L, H] up-projection ``kernel`` quantised to FP8 with per-column scales.

    Computed in float32: scale[j] = amax(|kernel[:, j]|) / the format's max (1 for an all-zero
    column), values = kernel / scale clipped to the format's range and rounded to it (a cast beyond
    E4M3FNUZ's range would be NaN). Each value is off by at most half a unit in the format's last
    place (a relative error <= 2^-4), or the format's subnormal spacing times the scale.

    Args:
      kernel: a float array [L, H], numpy or jax, any float dtype (a checkpoint's bf16 kernel).
      dtype: "float8_e4m3fn" or "float8_e4m3fnuz" (or the jnp dtype); None: the format ``device``
        multiplies natively, which FP8 activations need there.
      device: a ``jax.Device`` of the mesh the tail runs on, exactly when ``dtype`` is None.

    Returns:
      ``QuantizedKernel(values, scale)``; its ``dtype.name`` is the ``TailConfig.up_proj_dtype`` to use.

    Raises:
      ValueError: naming the argument, for neither or both of ``dtype`` and ``device``, an unknown
        format, a device that is no ``jax.Device`` (:func:`k3_tail.hardware.check_device`: "rocm" says
        neither E4M3FN nor E4M3FNUZ) or a GPU whose format is not known, a kernel that is not a
        non-empty 2-d float array, or a concrete kernel with a non-finite value (under ``jax.jit`` it
        cannot be inspected: its column's scale becomes non-finite).
    """
    device = check_device(device, optional=True)
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
    """``latent @ kernel``: [T, L] x [L, N] -> float32 [T, N], 2TLN FLOPs, accumulated in float32.

    A :class:`QuantizedKernel` is read as FP8 (L*N bytes) and its result scaled per column; with
    ``fp8_activations`` the rows are quantised per token to its format first (module docstring).
    """
    rows = latent.shape[0]
    with jax.named_scope(UP_PROJECTION):
        # One row is multiplied as two, the second zero: XLA turns a one-row product with a narrow kernel into
        # a multiply that writes a float32 transposed copy of the kernel and a reduce (GPU), or a slower
        # matrix-vector path (CPU); two rows stay one GEMM that reads the kernel once in its stored dtype
        # (docs/design.md, "One-row GEMMs").
        padded = jnp.pad(latent, [(0, gemm_rows(rows) - rows), (0, 0)])
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
    """``projected``, a GEMM's result, as a value XLA cannot add to inside the GEMM on ``platform`` "rocm"
    (an optimisation barrier, which emits no kernel); as is on "cuda" and "cpu"; for "gpu" (either vendor) or
    None (not known) decided for the platform the program is lowered for."""
    # XLA's GEMM rewriter folds ``dot + x`` into a library GEMM that accumulates into a C operand, the form
    # vLLM ROCm removed from this tail: hipBLASLt's C-accumulating GEMM faults at some row counts
    # (docs/design.md, "No C-accumulating GEMM on ROCm"). The rewriter cannot see through a barrier.
    if platform in ("gpu", None):
        return lax.platform_dependent(projected, rocm=lax.optimization_barrier, default=lambda x: x)
    if platform != "rocm":
        return projected
    return lax.optimization_barrier(projected)


def map_columns(function: Callable[[jax.Array], jax.Array], kernel: jax.Array | QuantizedKernel):
    """``function``, which acts on the last (column) axis only, applied to the kernel or to a
    QuantizedKernel's values and scale alike."""
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
    kernel: Any, *, dtype: np.dtype, up_proj_dtype: np.dtype | None, shapes: Sequence[tuple[int, int]], sizes: str,
    column_block: bool = False,
) -> None:
    """ValueError naming ``up_proj_kernel`` unless ``kernel`` is an array of ``dtype`` with one of
    ``shapes`` (``up_proj_dtype`` None), or a QuantizedKernel of ``up_proj_dtype`` whose values have one
    of ``shapes`` [L, N] and whose scale is float32 [N]; ``sizes`` names the sizes, for the message, and
    ``column_block`` says that ``shapes`` is one rank's column block (the column layout inside
    ``jax.shard_map``). A wrong shape's message names the likely fix (:func:`kernel_shape_hint`)."""
    def hint(shape: tuple[int, ...]) -> str | None:
        return kernel_shape_hint(shape, shapes, column_block=column_block)

    if up_proj_dtype is None:
        if isinstance(kernel, QuantizedKernel):
            raise ValueError(
                f"up_proj_kernel: got a QuantizedKernel ({kernel.dtype.name}) but config.up_proj_dtype is None: "
                f"expected a {dtype.name} array; set TailConfig(up_proj_dtype={kernel.dtype.name!r}) to use it"
            )
        expect_array(kernel, "up_proj_kernel", shapes, dtype, sizes, shape_hint=hint)
        return
    if not isinstance(kernel, QuantizedKernel):
        raise ValueError(
            f"up_proj_kernel: config.up_proj_dtype is {up_proj_dtype.name}, so expected a k3_tail.QuantizedKernel "
            f"(k3_tail.quantize_up_proj(kernel, {up_proj_dtype.name!r})), got {describe(kernel)}"
        )
    expect_array(kernel.values, "up_proj_kernel", shapes, up_proj_dtype, f"values: {sizes}",
                 dtype_field="config.up_proj_dtype", shape_hint=hint)
    expect_array(kernel.scale, "up_proj_kernel", [kernel.values.shape[1:]], np.dtype(np.float32),
                 "scale: one per column", dtype_field="float32 scales")


# The likely fixes of a kernel of the wrong shape (kernel_shape_hint).
TRANSPOSED_HINT = "transposed? a kernel is [L, H] (torch's weight is [H, L]: pass weight.T)"
WHOLE_KERNEL_HINT = ("the column layout takes this rank's [L, padded_hidden_size(H, p) / p] block: pad the [L, H] "
                     "kernel to k3_tail.padded_hidden_size(H, p) columns and pass it with in_spec P(None, axis)")


def kernel_shape_hint(shape: tuple[int, ...], shapes: Sequence[tuple[int, int]], *, column_block: bool) -> str | None:
    """The likely fix when a kernel of ``shape`` came where one of ``shapes`` [L, N] was expected: the
    transpose of one of them (torch's [N, L] weight), or, for one rank's column block (``column_block``),
    more than N columns (the whole kernel, padded or not, where the shard_map should have split it), maybe
    transposed too. None for any other shape."""
    latent, block = shapes[0]
    if tuple(reversed(shape)) in shapes:
        return TRANSPOSED_HINT
    if column_block and len(shape) == 2:
        if shape[0] == latent and shape[1] > block:
            return WHOLE_KERNEL_HINT
        if shape[1] == latent and shape[0] > block:
            return f"{TRANSPOSED_HINT}; and {WHOLE_KERNEL_HINT}"
    return None
