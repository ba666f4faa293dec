"""The up projection's weights and its GEMM: the kernel in ``config.dtype`` or quantised to FP8.

"float8_e4m3fn" is OCP E4M3 (MI355X, H100/H200); "float8_e4m3fnuz" gfx942's (MI300X/MI325X: no infinity, no
negative zero, largest value 240): docs/design.md, "FP8 up-projection weights". :func:`project` is every tier's
GEMM.
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
    """An up-projection kernel ``values * scale`` in FP8 (a JAX pytree, from :func:`quantize_up_proj`), taken
    wherever a kernel is when ``TailConfig.up_proj_dtype`` is its format.

    Attributes: ``values`` FP8 [L, N] (N = H, or a rank's column block), ``scale`` float32 [N].
    """

    values: Any
    scale: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.values.dtype)

    def dequantize(self) -> jax.Array:
        """``values * scale`` in float32, [L, N]."""
        return jnp.asarray(self.values, jnp.float32) * jnp.asarray(self.scale, jnp.float32)


def fp8_format(value: Any, argument: str) -> np.dtype:
    """``value`` (a name or a dtype) as one of :data:`FP8_FORMATS`, or ValueError naming ``argument``."""
    try:
        dtype = None if value is None else np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in FP8_FORMATS:
        raise ValueError(f"{argument}: expected one of {FP8_FORMATS} (a name or a jnp dtype), got {value!r}")
    return dtype


# The platforms where FP8 activations must match the device's format: XLA:CPU computes either in float32.
_FP8_CHECKED_PLATFORMS = ("rocm", "cuda")
# The format for a device without FP8 matrix units (the CPU): OCP's, which has the larger range.
_DEFAULT_FP8_FORMAT = "float8_e4m3fn"


def native_fp8_format(device: Any) -> str:
    """The FP8 format (dtype name) ``device``'s GPU multiplies natively; "float8_e4m3fn" on a CPU. ValueError
    naming ``device`` for a GPU whose device kind :mod:`k3_tail.hardware` does not know."""
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
    """ValueError when FP8 activations in format ``up_proj_dtype`` would not make an FP8 GEMM on ``device``'s GPU
    (XLA would convert both operands of another format to float16), or its kind is not known."""
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
    """The [L, H] up-projection ``kernel`` quantised to FP8: scale[j] = amax(|kernel[:, j]|) / the format's max
    (1 for a zero column), values = kernel / scale clipped and rounded to the format, in float32. Error per value:
    half a unit in the format's last place (relative <= 2^-4), or its subnormal spacing times the scale.

    Args:
      kernel: a float array [L, H], numpy or jax, any float dtype (a checkpoint's bf16 kernel).
      dtype: "float8_e4m3fn" or "float8_e4m3fnuz" (or the jnp dtype); None: the one ``device`` multiplies.
      device: a ``jax.Device`` of the mesh the tail runs on, exactly when ``dtype`` is None.

    Returns:
      ``QuantizedKernel(values, scale)``; its ``dtype.name`` is the ``TailConfig.up_proj_dtype`` to use.

    Raises:
      ValueError: naming the argument, for neither or both of ``dtype`` and ``device``, an unknown format, a
        device that is no ``jax.Device`` or a GPU whose format is not known, a kernel that is not a non-empty
        2-d float array, or a concrete kernel with a non-finite value (traced: its column's scale is non-finite).
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
    """amax / the format's largest value; 1 where amax is 0."""
    scale = amax / float(jnp.finfo(fp8).max)
    return jnp.where(scale > 0, scale, 1.0)


def _round_to(x: jax.Array, fp8: np.dtype) -> jax.Array:
    """float32 ``x`` clipped to ``fp8``'s range (a cast beyond E4M3FNUZ's is NaN) and rounded to it."""
    largest = float(jnp.finfo(fp8).max)
    return jnp.clip(x, -largest, largest).astype(fp8)


def project(latent: jax.Array, kernel: jax.Array | QuantizedKernel, *, fp8_activations: bool = False) -> jax.Array:
    """``latent @ kernel``: [T, L] x [L, N] -> float32 [T, N], 2TLN FLOPs, accumulated in float32. A
    :class:`QuantizedKernel` is read as FP8 (L*N bytes); ``fp8_activations`` quantises the rows per token too."""
    rows = latent.shape[0]
    with jax.named_scope(UP_PROJECTION):
        # One row is multiplied as two, the second zero: XLA turns a one-row product into a multiply that writes
        # a float32 copy of the kernel (GPU) or a slower path (CPU) (docs/design.md, "Two GEMM forms XLA is kept from").
        padded = jnp.pad(latent, [(0, gemm_rows(rows) - rows), (0, 0)])
        return _project_rows(padded, kernel, fp8_activations=fp8_activations)[:rows]


def gemm_rows(rows: int) -> int:
    """The rows the GEMM of :func:`project` multiplies for ``rows`` latent rows: 2 for one, else ``rows``."""
    return 2 if rows == 1 else rows


def _project_rows(latent: jax.Array, kernel: jax.Array | QuantizedKernel, *, fp8_activations: bool) -> jax.Array:
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
    """``projected``, a GEMM's result, behind an optimisation barrier (no kernel) on "rocm", as is on "cuda" and
    "cpu"; for "gpu" or None decided as the program lowers."""
    # XLA's GEMM rewriter folds ``dot + x`` into a GEMM accumulating into C, which faults in hipBLASLt at some
    # row counts (docs/design.md, "Two GEMM forms XLA is kept from"); it cannot see through a barrier.
    if platform in ("gpu", None):
        return lax.platform_dependent(projected, rocm=lax.optimization_barrier, default=lambda x: x)
    if platform != "rocm":
        return projected
    return lax.optimization_barrier(projected)


def map_columns(function: Callable[[jax.Array], jax.Array], kernel: jax.Array | QuantizedKernel):
    """``function`` (of the last, column axis) applied to the kernel, or to a QuantizedKernel's leaves alike."""
    return jax.tree.map(function, kernel)


def column_spec(kernel: jax.Array | QuantizedKernel | None, axis_name: Any) -> Any:
    """The spec per leaf of a kernel sharded by columns over ``axis_name`` (``P(None, axis_name)`` for values,
    ``P(axis_name)`` for scales), or replicated (``P()``) when ``axis_name`` is None."""
    values = P() if axis_name is None else P(None, axis_name)
    if isinstance(kernel, QuantizedKernel):
        return QuantizedKernel(values, P() if axis_name is None else P(axis_name))
    return values


def column_sharding(kernel: jax.Array | QuantizedKernel, mesh: Mesh, axis_name: Any) -> Any:
    """:func:`column_spec` as ``NamedSharding`` over ``mesh``, for ``jax.device_put``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), column_spec(kernel, axis_name),
                        is_leaf=lambda x: isinstance(x, P))


def check_up_proj_kernel(
    kernel: Any, *, dtype: np.dtype, up_proj_dtype: np.dtype | None, shapes: Sequence[tuple[int, int]], sizes: str,
    column_block: bool = False,
) -> None:
    """ValueError naming ``up_proj_kernel`` unless ``kernel`` is an array of ``dtype`` with one of ``shapes``
    (``up_proj_dtype`` None), or a QuantizedKernel of ``up_proj_dtype`` with values of one of ``shapes`` [L, N]
    and a float32 [N] scale. ``sizes`` names the sizes; ``column_block``: ``shapes`` is one rank's block."""
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


TRANSPOSED_HINT = "transposed? a kernel is [L, H] (torch's weight is [H, L]: pass weight.T)"
WHOLE_KERNEL_HINT = ("the column layout takes this rank's [L, padded_hidden_size(H, p) / p] block: pad the [L, H] "
                     "kernel to k3_tail.padded_hidden_size(H, p) columns and pass it with in_spec P(None, axis)")


def kernel_shape_hint(shape: tuple[int, ...], shapes: Sequence[tuple[int, int]], *, column_block: bool) -> str | None:
    """The likely fix when a kernel of ``shape`` came where one of ``shapes`` [L, N] was expected (a transpose, or
    for a column block the whole kernel), or None."""
    latent, block = shapes[0]
    if tuple(reversed(shape)) in shapes:
        return TRANSPOSED_HINT
    if column_block and len(shape) == 2:
        if shape[0] == latent and shape[1] > block:
            return WHOLE_KERNEL_HINT
        if shape[1] == latent and shape[0] > block:
            return f"{TRANSPOSED_HINT}; and {WHOLE_KERNEL_HINT}"
    return None
