"""MXFP4 routed experts for the Kimi-K3 layer example: the kernels the layer holds packed (:class:`Mxfp4Kernel`, in
its layout [E, in, out] packed along the input axis), and the memory they save.

Memory per rank, one Kimi-K3 MoE layer's routed experts at p = 8 (896 experts, m = 3072, L = 3584:
3 * 896 * 3584 * 384 = 3,699,376,128 weights per rank; :func:`expert_bytes_per_rank`):

| experts held as | bytes per weight | per rank, one layer | 92 MoE layers |
| --- | --- | --- | --- |
| MXFP4, packed (this layer) | 0.53125 (1/2 code + 1/32 scale) | 1,965,293,568 (1.97 GB) | 180.8 GB |
| bfloat16, decoded at load | 2 | 7,398,752,256 (7.40 GB) | 680.7 GB |

No program writes a decoded copy of the experts (docs/measurements/2026-12-01-mxfp4-experts.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from k3_tail import hardware
from k3_tail.models.kimi_k3.gemm import matmul
from k3_tail.models.kimi_k3.mxfp4 import (
    CODES_PER_BYTE,
    E2M1_MAGNITUDES,
    GROUP_SIZE,
    MXFP4_BYTES,
    SCALE_BIAS,
    decode,
    decode_by_group,
)
from k3_tail.models.kimi_k3.mxfp4_matmul import mxfp4_matmul


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Kernel:
    """A kernel [..., K, N] (y = x @ W over K) held as MXFP4 (a pytree): ``packed`` uint8 [..., K/2, N] (low nibble
    the even row of K) and ``scale`` uint8 [..., K/32, N]. ``selected`` (int32 [S], or None: all) picks S kernels
    of the leading (expert) axis without moving them."""

    packed: jax.Array
    scale: jax.Array
    selected: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The decoded kernel's shape [..., K, N] (of the selected kernels)."""
        *leading, half, columns = self.packed.shape
        if self.selected is not None:
            leading = [*self.selected.shape, *leading[1:]]
        return (*leading, CODES_PER_BYTE * half, columns)

    def __getitem__(self, index) -> Mxfp4Kernel:
        """The kernels picked by ``index`` over the leading (expert) axes, still packed."""
        packed, scale = self.gathered()
        return Mxfp4Kernel(packed[index], scale[index])

    def gathered(self) -> tuple[jax.Array, jax.Array]:
        """(packed, scale) of the selected kernels, gathered (a copy, but where a fusion consumes it)."""
        if self.selected is None:
            return self.packed, self.scale
        return self.packed[self.selected], self.scale[self.selected]

    def decode(self, dtype) -> jax.Array:
        """The (selected) kernels' values [..., K, N] in ``dtype`` (``k3_tail.models.kimi_k3.mxfp4.decode``)."""
        return decode(*self.gathered(), dtype)

    def decode_by_group(self, dtype) -> jax.Array:
        """The (selected) kernels' values [..., K/32, 16, 2, N] in ``dtype`` (:func:`.mxfp4.decode_by_group`)."""
        return decode_by_group(*self.gathered(), dtype)

    def matmul(self, rows: jax.Array, *, interpret: bool = False) -> jax.Array:
        """rows [S, C, K] times the S selected kernels [S, K, N] -> float32 [S, C, N], products in the rows' dtype:
        on a GPU :func:`.mxfp4_matmul.mxfp4_matmul`, elsewhere XLA's GEMM of the decoded kernels. ``interpret``: the
        GPU's kernel in Pallas's interpret mode, on any platform."""

        def in_kernel(rows, packed, scale, selected):
            return mxfp4_matmul(rows, packed, scale, kernels=selected, interpret=interpret)

        def decoded(rows, packed, scale, selected):
            return matmul(rows, decode(packed[selected], scale[selected], rows.dtype))

        selected = jnp.arange(self.packed.shape[0]) if self.selected is None else self.selected
        if interpret:
            return in_kernel(rows, self.packed, self.scale, selected)
        return jax.lax.platform_dependent(rows, self.packed, self.scale, selected, cuda=in_kernel, rocm=in_kernel,
                                          default=decoded)

    def experts(self, start: jax.Array, count: int) -> Mxfp4Kernel:
        """Experts start .. start + count - 1 of the leading axis, selected (nothing moves)."""
        return self.select(start + jnp.arange(count))

    def select(self, experts: jax.Array) -> Mxfp4Kernel:
        """Experts ``experts`` (int [S]) of the leading axis, selected (nothing moves)."""
        return Mxfp4Kernel(self.packed, self.scale, jnp.asarray(experts, jnp.int32))


def kernel_arrays(kernel: jax.Array | Mxfp4Kernel) -> tuple[jax.Array, ...]:
    """The arrays of an expert kernel: (the array,), or MXFP4's (codes, scales)."""
    return (kernel.packed, kernel.scale) if isinstance(kernel, Mxfp4Kernel) else (kernel,)


def dense(kernel: jax.Array | Mxfp4Kernel, dtype) -> jax.Array:
    """``kernel``'s values in ``dtype``: an :class:`Mxfp4Kernel` decoded, an array cast (a no-op in its own dtype)."""
    return kernel.decode(dtype) if isinstance(kernel, Mxfp4Kernel) else kernel.astype(dtype)


def random_codes(rng: np.random.Generator, shape: tuple[int, ...], stddev: float) -> tuple[np.ndarray, np.ndarray]:
    """Stand-in MXFP4 kernel (packed, scale) of decoded shape [..., K, N]: uniform random codes and one scale, the
    power of two that brings their root mean square nearest ``stddev``."""
    *leading, rows, columns = shape
    rms = float(np.sqrt(np.mean(np.square(E2M1_MAGNITUDES))))
    exponent = SCALE_BIAS + round(float(np.log2(stddev / rms)))
    packed = rng.integers(0, 256, (*leading, rows // CODES_PER_BYTE, columns), dtype=np.uint8)
    return packed, np.full((*leading, rows // GROUP_SIZE, columns), exponent, np.uint8)


def expert_bytes_per_rank(num_experts: int, latent_size: int, expert_intermediate_size: int, tp_size: int,
                          bytes_per_weight: float) -> int:
    """Bytes one rank holds of one layer's routed experts: 3 kernels of L x m/p per expert, at ``bytes_per_weight``
    (``MXFP4_BYTES`` packed, the dtype's itemsize decoded)."""
    weights = 3 * num_experts * latent_size * (expert_intermediate_size // tp_size)
    return round(weights * bytes_per_weight)


# How each routed-expert method computes with MXFP4 experts, on every target.
DECODE_PATHS = {
    "gather": "the T*k chosen blocks' codes gathered and decoded inside the multiply-reduce that consumes them",
    "capacity": "S = E/16 experts at a time decoded to the layer's dtype right before their GEMMs (a loop)",
    "ragged_dot": "every expert decoded to the layer's dtype before the grouped GEMMs",
}
# The capacity method's GEMMs on a GPU (Mxfp4Kernel.matmul).
IN_KERNEL_PATH = ("S = E/16 experts at a time (a loop), each GEMM one Pallas kernel that decodes the codes in its "
                  "operand load (k3_tail.models.kimi_k3.mxfp4_matmul)")
# Kimi-K3's MoE layers (of 93) and the HBM a one-time decode of every layer would have to fit (data sheets).
KIMI_K3_MOE_LAYERS = 92
HBM_BYTES = {"mi300x": 192e9, "mi355x": 288e9, "h200": 141e9}
# A one-time decode to FP8 with the group scales kept (MSLK's choice on gfx942): a byte a weight and a 32nd of one.
FP8_WITH_GROUP_SCALES_BYTES = 1 + 1 / GROUP_SIZE
# Activation formats in MX blocks of 32, with the exponent of each one's largest power of two (the MX scale is
# 2^(floor(log2(amax)) - that)).
ACTIVATION_FORMATS = {"mxfp4": (ml_dtypes.float4_e2m1fn, 2), "mxfp8": (ml_dtypes.float8_e4m3fn, 8)}


@dataclasses.dataclass(frozen=True)
class Mxfp4Path:
    """How a call computes with MXFP4 experts (``decode``: :data:`DECODE_PATHS`' words for its method) and why no
    other route is taken on its device (``reason``)."""

    decode: str
    reason: str


def mxfp4_path(method: str, device, *, num_experts: int = 896, latent_size: int = 3584,
               expert_intermediate_size: int = 3072, tp_size: int = 8) -> Mxfp4Path:
    """The path MXFP4 experts take for routed-expert ``method`` on ``device`` (a ``jax.Device``), with the reason no
    other route is taken there; the sizes (Kimi-K3's by default) size the one-time decode it weighs. ValueError
    naming ``method`` when it is not a routed-expert method."""
    if method not in DECODE_PATHS:
        raise ValueError(f"method: expected one of {tuple(DECODE_PATHS)}, got {method!r}")
    platform = hardware.device_platform(device)
    decode = IN_KERNEL_PATH if method == "capacity" and platform in hardware.GPU_VENDOR_PLATFORMS else (
        DECODE_PATHS[method])
    preset = hardware.architecture(getattr(device, "device_kind", "")) if platform in hardware.GPU_PLATFORMS else None
    if preset == "mi355x":
        reason = ("gfx950's MXFP4 matrix instruction (v_mfma_scale_f32_*_f8f6f4, which jax.nn.scaled_matmul reaches "
                  "for FP4 codes of both operands) takes both operands in at most 8 bits, and these experts' "
                  "activations are bf16, as the checkpoint's quantization_config leaves them: quantising them "
                  "would change the layer's function")
        if jax.__version_info__ < (0, 11):
            reason += f"; and jax {jax.__version__}'s XLA cannot lower a block-scaled FP4 product for ROCm"
    elif preset == "mi300x":
        held = expert_bytes_per_rank(num_experts, latent_size, expert_intermediate_size, tp_size,
                                     FP8_WITH_GROUP_SCALES_BYTES)
        reason = (f"gfx942 has no FP4 matrix instruction nor FP4 convert; a one-time decode to FP8 with the group "
                  f"scales kept would hold {held / 1e9:.2f} GB a layer per rank at p = {tp_size}, "
                  f"{held * KIMI_K3_MOE_LAYERS / 1e9:.0f} GB for Kimi-K3's {KIMI_K3_MOE_LAYERS} MoE layers, against "
                  f"{HBM_BYTES[preset] / 1e9:.0f} GB of HBM, and gfx942's FP8 GEMMs take no scale per group of K")
    elif preset == "h200":
        reason = (f"Hopper's tensor cores multiply FP8 at most, and an FP8 copy would hold "
                  f"{FP8_WITH_GROUP_SCALES_BYTES / MXFP4_BYTES:.2f}x the packed bytes")
    else:
        reason = f"no native MXFP4 product is known for a {getattr(device, 'device_kind', device)} device"
    return Mxfp4Path(decode, reason)


def activation_quantization_error(activation_format: str | None, *, rows: int = 16, depth: int = 3584,
                                  columns: int = 384, seed: int = 0) -> float:
    """The relative Frobenius error, against the exact float64 product, of one expert's x @ W (x [rows, depth]
    standard normal, W [depth, columns] random MXFP4) when x is first rounded to bfloat16 (``activation_format``
    None: what the layer does) or quantised in MX blocks of 32 to "mxfp4" or "mxfp8" (E4M3), in float64.
    ValueError for another format."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth))
    codes = rng.integers(0, 16, (depth, columns), dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    weights = codes * np.repeat(2.0 ** rng.integers(-8, -4, (depth // GROUP_SIZE, columns)), GROUP_SIZE, axis=0)
    if activation_format is None:
        quantised = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    elif activation_format in ACTIVATION_FORMATS:
        element, largest_exponent = ACTIVATION_FORMATS[activation_format]
        largest = float(ml_dtypes.finfo(element).max)
        blocks = x.reshape(rows, depth // GROUP_SIZE, GROUP_SIZE)
        scales = 2.0 ** (np.floor(np.log2(np.abs(blocks).max(axis=-1, keepdims=True))) - largest_exponent)
        values = np.clip(blocks / scales, -largest, largest).astype(element).astype(np.float64)
        quantised = (values * scales).reshape(rows, depth)
    else:
        raise ValueError(f"activation_format: expected None or one of {tuple(ACTIVATION_FORMATS)}, "
                         f"got {activation_format!r}")
    exact = x @ weights
    return float(np.linalg.norm(quantised @ weights - exact) / np.linalg.norm(exact))
