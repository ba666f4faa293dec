"""MXFP4 routed experts for the Kimi-K3 layer example: the kernels the layer holds packed, and the memory they save.

Kimi-K3 ships its routed experts as compressed-tensors' ``mxfp4-pack-quantized`` (the OCP Microscaling MXFP4
format); :mod:`k3_tail.models.kimi_k3.mxfp4` has the format's facts, its bytes per weight and its exact decoder.

In the layer the experts stay packed (:class:`Mxfp4Kernel`), in its Flax layout [E, in, out] with the
packing along the input axis: the gate and up kernels [E, L/2, m] and [E, L/32, m], the down kernel
[E, m/2, L] and [E, m/32, L], sharded over the intermediate width m like the bf16 kernels. They are decoded
inside the jitted expert computation, where each method uses a kernel (k3_tail/models/kimi_k3/routed_experts.py):
the gather method decodes only the T*k gathered blocks, inside the fusion that multiplies and reduces them.
A GPU program decodes them through ``float4_e2m1fn`` and ``float8_e8m0fnu`` alone; a CPU program builds the
values from their bits, since XLA:CPU's float arithmetic flushes those under the scales 2^-127 and 2^-126.

Memory per rank, one Kimi-K3 MoE layer's routed experts at p = 8 (896 experts, m = 3072, L = 3584:
3 * 896 * 3584 * 384 = 3,699,376,128 weights per rank; :func:`expert_bytes_per_rank`):

| experts held as | bytes per weight | per rank, one layer | 92 MoE layers |
| --- | --- | --- | --- |
| MXFP4, packed (this layer) | 0.53125 (1/2 code + 1/32 scale) | 1,965,293,568 (1.97 GB) | 180.8 GB |
| bfloat16, decoded at load | 2 | 7,398,752,256 (7.40 GB) | 680.7 GB |

The layer compiled at Kimi-K3's shapes (896 experts, top 16, p = 8) has exactly these bytes per rank
in its arguments, beside the rest of the layer (148,646,400 bytes with the replicated up projection)
and the hidden states. ``python -m k3_tail.models.kimi_k3.mxfp4_experts [--topology cpu|h100x8|mi300xx8|mi355xx8]
[--tokens 1,16,2048]`` compiles the layer both ways and prints per T the path the MXFP4 experts take and,
per rank, temp bytes, bytes accessed and kernels against bf16 experts (:func:`compiled_figures`). No
program writes a decoded copy of the experts: the gather method (decode) reduces over the group axes of
``decode_by_group``, so XLA fuses the gather of the codes into the multiply-reduce, and the capacity
method (prefill) takes S = E/16 experts at a time, each of its GEMMs on a GPU one Pallas kernel that decodes
the codes in its operand load (:meth:`Mxfp4Kernel.matmul`, ``k3_tail.models.kimi_k3.mxfp4_matmul``; XLA fuses no decode
into a GEMM and wrote each group's kernels decoded, 154 MB each); the layer's temp memory
(docs/measurements/2026-12-01-mxfp4-experts.md has the table) is 1.6-1.7 / 5.1-6.2 MB at T = 1 / 16 (bf16
experts: 0.4-0.5 / 5.3-6.4) and 83-96 MB at T = 2048 (bf16: 0.67 GB), where it was 24 MB / 387 MB / 7.80 GB.
On the CPU the capacity GEMMs multiply the decoded group.

:func:`mxfp4_path` says, per method and device, which path a call takes and why no other route is (gfx950's
MXFP4 matrix instruction would need the activations quantised, whose cost :func:`activation_quantization_error`
measures; gfx942 has no FP4 instruction and a one-time FP8 copy does not fit it; Hopper multiplies FP8 at most).
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
    """A kernel [..., K, N] (y = x @ W over K) held as MXFP4: ``packed`` uint8 [..., K/2, N], two codes per
    byte along K (low nibble the even row), and ``scale`` uint8 [..., K/32, N], one E8M0 exponent per 32
    rows of K. ``selected`` (int32 [S], or None: all) picks S kernels of the leading (expert) axis without
    moving them: what :meth:`matmul` multiplies (:meth:`experts`, :meth:`select`). A pytree, so it passes
    through ``jax.jit`` and ``shard_map`` as its arrays."""

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
        """The kernels picked by ``index`` over the leading (expert) axes, still packed: gathering them moves
        0.53 bytes per weight (where the gather feeds a fusion, XLA reads them in place)."""
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
        """rows [S, C, K] (the layer's dtype) times the S selected kernels [S, K, N] (all, when none are selected),
        float32 [S, C, N], products in the rows' dtype: on a GPU one Pallas kernel that reads the codes where they
        lie, decodes them in its operand load and writes no decoded weight (``k3_tail.models.kimi_k3.mxfp4_matmul``),
        elsewhere XLA's GEMM of the decoded kernels (:func:`dense`). ``interpret``: the GPU's kernel on any
        platform, in Pallas's interpret mode (a CPU runs what a GPU would)."""

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
    """Stand-in MXFP4 kernel (packed [..., K/2, N], scale [..., K/32, N]) of decoded shape [..., K, N]: uniform
    random codes (the E2M1 values' root mean square is sqrt(8.5625), about 2.93) and one scale, the power of two
    that brings that nearest ``stddev``."""
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


# How each routed-expert method computes with MXFP4 experts, on every target (k3_tail/models/kimi_k3/routed_experts.py).
DECODE_PATHS = {
    "gather": "the T*k chosen blocks' codes gathered and decoded inside the multiply-reduce that consumes them",
    "capacity": "S = E/16 experts at a time decoded to the layer's dtype right before their GEMMs (a loop)",
    "ragged_dot": "every expert decoded to the layer's dtype before the grouped GEMMs",
}
# The capacity method's GEMMs on a GPU (Mxfp4Kernel.matmul).
IN_KERNEL_PATH = ("S = E/16 experts at a time (a loop), each GEMM one Pallas kernel that decodes the codes in its "
                  "operand load (k3_tail.models.kimi_k3.mxfp4_matmul)")
# Kimi-K3's MoE layers (93 decoder layers, the first dense) and the HBM of the GPUs whose MXFP4 routes differ, from
# their data sheets (k3_tail/hardware.py's presets cite them): what a one-time decode of every layer would have to fit.
KIMI_K3_MOE_LAYERS = 92
HBM_BYTES = {"mi300x": 192e9, "mi355x": 288e9, "h200": 141e9}
# A one-time decode to FP8 with the group scales kept (MSLK's choice on gfx942): a byte a weight and a 32nd of one.
FP8_WITH_GROUP_SCALES_BYTES = 1 + 1 / GROUP_SIZE
# The element formats activations could be quantised to in MX blocks of 32 (for a native block-scaled product), with
# the exponent of each one's largest power of two: the MX shared scale is 2^(floor(log2(amax)) - that).
ACTIVATION_FORMATS = {"mxfp4": (ml_dtypes.float4_e2m1fn, 2), "mxfp8": (ml_dtypes.float8_e4m3fn, 8)}


@dataclasses.dataclass(frozen=True)
class Mxfp4Path:
    """How a call computes with MXFP4 experts (``decode``: :data:`DECODE_PATHS`' words for its method) and why no
    other route is taken on its device (``reason``)."""

    decode: str
    reason: str


def mxfp4_path(method: str, device, *, num_experts: int = 896, latent_size: int = 3584,
               expert_intermediate_size: int = 3072, tp_size: int = 8) -> Mxfp4Path:
    """The path MXFP4 experts take for routed-expert ``method`` on ``device`` (a ``jax.Device``), with the reason
    that applies to that device; the sizes (Kimi-K3's by default) size the one-time decode it weighs.

    Every target keeps the bf16 layer's products (docs/kimi_k3.md, MXFP4 routed experts), the capacity GEMMs on a GPU
    decoding in the Pallas kernel's operand load (:data:`IN_KERNEL_PATH`): gfx950's block-scaled matrix
    instruction would need the activations quantised, gfx942 has no FP4 instruction and a one-time FP8 decode does
    not fit it, Hopper multiplies FP8 at most.
    ValueError naming ``method`` when it is not a routed-expert method."""
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
    """The relative error (Frobenius norm, against the exact float64 product) of one expert's product
    x @ W, x [rows, depth] standard normal and W [depth, columns] MXFP4 (uniform random codes, random scales
    2^-8 .. 2^-5 per group), when x is first rounded to bfloat16 (``activation_format`` None: what the layer does)
    or quantised in MX blocks of 32 along ``depth`` to "mxfp4" or "mxfp8" (E4M3; the MX rule, values over the
    block's scale rounded to nearest and clamped to the format's largest). In float64 with ml_dtypes: no backend's
    arithmetic in it. What a native block-scaled product would cost these experts (docs/kimi_k3.md)."""
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
