"""MXFP4 routed experts for the Kimi-K3 layer example: the format, its exact decoder, and the memory it saves.

Kimi-K3 ships its routed experts as compressed-tensors' ``mxfp4-pack-quantized`` (the OCP Microscaling
MXFP4 format): for each torch Linear weight [out, in],

    weight_packed  uint8 [out, in / 2]    two E2M1 codes per byte: the LOW nibble is the even input column
    weight_scale   uint8 [out, in / 32]   one E8M0 exponent u per 32 input columns: the scale 2^(u - 127)

An E2M1 code is 4 bits s e e m: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 by the 3 bits e e m (e = 0 a
subnormal: m * 0.5; else (1 + m / 2) * 2^(e - 1)), negative when s is set (code 8 is -0). A weight is its
code's value times its group's scale. u = 0 is 2^-127 (a float32 and bfloat16 subnormal) and u = 254 is
2^127. u = 255 is NaN, as the OCP MX specification (v1.0) defines E8M0's one NaN: every weight of that
group decodes to NaN, so a NaN in the checkpoint stays NaN through the layer. (compressed-tensors'
``decompress`` computes 2^(255 - 127) = inf there instead; ml_dtypes' ``float8_e8m0fnu`` is NaN too.)

In the layer the experts stay packed (:class:`Mxfp4Kernel`), in its Flax layout [E, in, out] with the
packing along the input axis: the gate and up kernels [E, L/2, m] and [E, L/32, m], the down kernel
[E, m/2, L] and [E, m/32, L], sharded over the intermediate width m like the bf16 kernels. They are decoded
inside the jitted expert computation, where each method uses a kernel (examples/kimi_k3_routed_experts.py):
the gather method decodes only the T*k gathered blocks, inside the fusion that multiplies and reduces them.

:func:`decode` builds each value's bits with integer operations (sign, exponent e + u - 1, one mantissa
bit; subnormal results as their integer multiple of the smallest subnormal), so the decoding is exact for
bfloat16 and float32 on every backend, XLA:CPU's flushing of subnormal arithmetic included. A value whose
exponent passes the format's largest finite one (u = 253 with |code| >= 4, u = 254 with |code| >= 2: up to
6 * 2^127, above bfloat16's and float32's largest finite, about 3.4e38) decodes to +-inf, as a rounding
cast would; the checkpoint loader refuses such groups (:func:`overflowing_groups`).

Memory per rank, one Kimi-K3 MoE layer's routed experts at p = 8 (896 experts, m = 3072, L = 3584:
3 * 896 * 3584 * 384 = 3,699,376,128 weights per rank; :func:`expert_bytes_per_rank`):

| experts held as | bytes per weight | per rank, one layer | 92 MoE layers |
| --- | --- | --- | --- |
| MXFP4, packed (this layer) | 0.53125 (1/2 code + 1/32 scale) | 1,965,293,568 (1.97 GB) | 180.8 GB |
| bfloat16, decoded at load | 2 | 7,398,752,256 (7.40 GB) | 680.7 GB |

The layer compiled at Kimi-K3's shapes (896 experts, top 16, p = 8) has exactly these bytes per rank
in its arguments, beside the rest of the layer (148,646,400 bytes with the replicated up projection)
and the hidden states: ``python -m examples.kimi_k3_mxfp4 [--topology cpu|h100x8|...] [--tokens 1,16,2048]``
compiles the layer both ways and prints its argument and temp bytes per rank. Its temp memory is where
the two differ at run time: XLA writes what it does not fuse. Compiled for a deviceless 8 x H100
(jax 0.10.2's XLA, which cannot autotune there), the decode (T = 1 / 16) copies the gathered packed
blocks before decoding them in the multiply-reduce fusion (temp 24 / 36 MB, against 0.5 / 6.6 MB for
bf16 experts), and the prefill's capacity GEMMs (T = 2048) read every expert's kernels decoded into a
bf16 buffer first (temp 7.85 GB, against 0.67 GB): even a plain uint8 -> bf16 convert stays a fusion
of its own in front of a GEMM in that compile, so whether XLA fuses the decode into the GEMM's operand
on a GPU (where it autotunes Triton fusions) is not shown here.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import k3_tail
# Bytes held per weight, packed: half a byte of code and a 32nd of a byte of scale (4.25 bits, as the cost tools
# price MXFP4 experts).
from k3_tail.tools.layer_cost import MXFP4_BYTES

# compressed-tensors' name of the format, in config.json's quantization_config.
QUANT_METHOD, FORMAT = "compressed-tensors", "mxfp4-pack-quantized"
# Input columns per E8M0 scale, and the codes one byte holds.
GROUP_SIZE, CODES_PER_BYTE = 32, 2
SCALE_BIAS, NAN_SCALE = 127, 255
# The E2M1 magnitudes by their 3 low bits (e e m).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# The dtypes decode writes: both have 8 exponent bits of bias 127, so every finite MXFP4 value up to 2^128 is
# exact in them, subnormals included (float16's 5 exponent bits hold only part of E8M0's range).
DECODED_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32))
_MANTISSA_BITS = {np.dtype(jnp.bfloat16): 7, np.dtype(np.float32): 23}
_BITS_DTYPES = {np.dtype(jnp.bfloat16): jnp.uint16, np.dtype(np.float32): jnp.uint32}
_EXPONENT_FIELD_MAX = 255  # all ones: inf and NaN
# The scales (2^126, 2^127) under which a large code passes the decoded dtypes' largest finite (255 is NaN).
OVERFLOWING_SCALES = (253, 254)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Kernel:
    """A kernel [..., K, N] (y = x @ W over K) held as MXFP4: ``packed`` uint8 [..., K/2, N], two codes per
    byte along K (low nibble the even row), and ``scale`` uint8 [..., K/32, N], one E8M0 exponent per 32
    rows of K. A pytree, so it passes through ``jax.jit`` and ``shard_map`` as its two arrays."""

    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The decoded kernel's shape [..., K, N]."""
        *leading, half, columns = self.packed.shape
        return (*leading, CODES_PER_BYTE * half, columns)

    def __getitem__(self, index) -> Mxfp4Kernel:
        """The kernels picked by ``index`` over the leading (expert) axes, still packed: gathering them moves
        0.53 bytes per weight."""
        return Mxfp4Kernel(self.packed[index], self.scale[index])

    def decode(self, dtype) -> jax.Array:
        """The kernel's values [..., K, N] in ``dtype`` (:func:`decode`)."""
        return decode(self.packed, self.scale, dtype)


def decode(packed: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The values [..., K, N] of MXFP4 codes ``packed`` uint8 [..., K/2, N] (low nibble the even row of K) with
    E8M0 exponents ``scale`` uint8 [..., K/32, N], in ``dtype`` (bfloat16 or float32), exactly: each value's
    bits are built with integer operations (module docstring); u = 255 gives NaN, a value past the dtype's
    largest finite +-inf. Elementwise after the unpacking, so XLA fuses it into what consumes the values.

    Raises:
      ValueError: naming the argument, for another dtype, arrays that are not uint8, or shapes that do not
        pair (K/2 bytes per 32 rows of one scale).
    """
    dtype = np.dtype(dtype)
    if dtype not in DECODED_DTYPES:
        raise ValueError(f"dtype: MXFP4 decodes to one of {tuple(d.name for d in DECODED_DTYPES)}, got {dtype.name}")
    for name, value in (("packed", packed), ("scale", scale)):
        if np.dtype(value.dtype) != np.uint8 or value.ndim < 2:
            raise ValueError(f"{name}: expected a uint8 array of at least 2 axes, got {value.dtype} {value.shape}")
    *leading, half, columns = packed.shape
    groups = half * CODES_PER_BYTE // GROUP_SIZE
    if half % (GROUP_SIZE // CODES_PER_BYTE) or tuple(scale.shape) != (*leading, groups, columns):
        raise ValueError(f"scale: expected shape {(*leading, groups, columns)} (one per {GROUP_SIZE} rows of packed "
                         f"{tuple(packed.shape)}, {GROUP_SIZE // CODES_PER_BYTE} bytes each), got {tuple(scale.shape)}")
    # By group, [..., K/32, 16, N], then [..., K/32, 16, 2, N]: the low nibble is row 2j, the high one row 2j + 1,
    # as a broadcast shift (elementwise: XLA fuses it into the consumer, where a stack is a concatenate it writes
    # out). The reshapes split or merge only minor, unsharded axes, so a global array sharded along K decodes too.
    grouped = packed.reshape(*leading, groups, GROUP_SIZE // CODES_PER_BYTE, 1, columns)
    nibble_shifts = jnp.array([0, 4], jnp.uint8)[:, None]
    codes = ((grouped >> nibble_shifts) & 0xF).reshape(*leading, groups, GROUP_SIZE, columns)
    bits = _value_bits(codes, scale[..., None, :], _MANTISSA_BITS[dtype])
    values = jax.lax.bitcast_convert_type(bits.astype(_BITS_DTYPES[dtype]), dtype)
    return values.reshape(*leading, groups * GROUP_SIZE, columns)


def _value_bits(codes: jax.Array, exponents: jax.Array, mantissa_bits: int) -> jax.Array:
    """The bits (uint32, in the low 1 + 8 + n bits) of code * 2^(u - 127) in a float format of 8 exponent bits
    (bias 127) and n = ``mantissa_bits`` mantissa bits, for E2M1 ``codes`` and E8M0 exponents u (broadcast)."""
    n = mantissa_bits
    c, u = codes.astype(jnp.int32), exponents.astype(jnp.int32)
    e, m = (c >> 1) & 3, c & 1
    # A code of e >= 1 is (1 + m/2) 2^(e - 1); e = 0, m = 1 is 2^-1. Times 2^(u - 127): the biased exponent.
    exponent = jnp.where(e > 0, e + u - 1, u - 1)
    normal = (exponent << n) | (jnp.where(e > 0, m, 0) << (n - 1))
    # Below the normal range (exponent <= 0: u <= 1) the value is an integer multiple of the smallest
    # subnormal 2^(-126 - n): 2|code| 2^(u - 128) = 2|code| 2^(u + n - 2) of them, and those bits are that integer.
    twice = jnp.where(e > 0, (2 + m) << jnp.maximum(e - 1, 0), m)
    subnormal = twice << (jnp.minimum(u, 1) + n - 2)
    infinite = _EXPONENT_FIELD_MAX << n
    magnitude = jnp.where(exponent >= _EXPONENT_FIELD_MAX, infinite, jnp.where(exponent <= 0, subnormal, normal))
    magnitude = jnp.where((c & 7) == 0, 0, magnitude)
    bits = ((c >> 3).astype(jnp.uint32) << (n + 8)) | magnitude.astype(jnp.uint32)
    quiet_nan = jnp.uint32(infinite | 1 << (n - 1))
    return jnp.where(u == NAN_SCALE, quiet_nan, bits)


def dense(kernel: jax.Array | Mxfp4Kernel, dtype) -> jax.Array:
    """``kernel``'s values in ``dtype``: an :class:`Mxfp4Kernel` decoded, an array cast (a no-op in its own dtype)."""
    return kernel.decode(dtype) if isinstance(kernel, Mxfp4Kernel) else kernel.astype(dtype)


def overflowing_groups(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Which groups hold a value past float32's and bfloat16's largest finite (about 3.4e38), on the host: bool of
    ``scale``'s shape [..., K/32, N] for ``packed`` [..., K/2, N] (:class:`Mxfp4Kernel`'s layout). A code of
    exponent bits e >= 1 times 2^(u - 127) has the biased exponent e + u - 1, past 254 when e + u >= 256; only
    :data:`OVERFLOWING_SCALES` can (u = 255 is NaN), so the codes matter only where the scale is one of those."""
    scale = np.asarray(scale)
    suspect = np.isin(scale, OVERFLOWING_SCALES)
    if not suspect.any():
        return suspect
    packed = np.asarray(packed)
    exponent_bits = np.maximum((packed >> 1) & 3, (packed >> 5) & 3)  # of the low and the high code
    *leading, half, columns = packed.shape
    group_max = exponent_bits.reshape(*leading, half * CODES_PER_BYTE // GROUP_SIZE, GROUP_SIZE // CODES_PER_BYTE,
                                      columns).max(axis=-2)
    return suspect & (group_max.astype(np.int32) + scale >= _EXPONENT_FIELD_MAX + 1)


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


def main(argv: list[str] | None = None) -> int:
    """Per rank, one Kimi-K3 MoE layer (896 experts, top 16) at p = 8: the routed experts' bytes from the
    shapes, and the layer compiled with bf16 and with MXFP4 experts (argument and temp bytes per T)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--topology", default="cpu", help="cpu (8 CPU devices) or a deviceless GPU topology "
                        "of k3_tail.topology_mesh, e.g. h100x8 (default: cpu)")
    parser.add_argument("--tokens", default="1,2048", help="token counts, comma-separated (default: 1,2048)")
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # compiles only: a deviceless topology needs no GPU backend
    jax.config.update("jax_num_cpu_devices", 8)
    from examples import kimi_k3_moe_layer as layer_module  # here: the layer imports this module

    mesh = (jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8]) if args.topology == "cpu"
            else k3_tail.topology_mesh(args.topology))
    tp_size, experts = mesh.shape["tp"], layer_module.KIMI_K3_NUM_EXPERTS
    for name, per_weight in (("mxfp4", MXFP4_BYTES), ("bfloat16", 2)):
        held = expert_bytes_per_rank(experts, 3584, layer_module.KIMI_K3_EXPERT_INTERMEDIATE_SIZE, tp_size, per_weight)
        print(f"routed experts held as {name}: {held:,} bytes per rank ({per_weight:g} bytes per weight)")
    print(f"compiled for {args.topology} (p = {tp_size}), per rank:")
    for quantization in ("mxfp4", None):
        config = layer_module.LayerConfig.kimi_k3(num_experts=experts, top_k=layer_module.KIMI_K3_TOP_K,
                                                  expert_quantization=quantization)
        for num_tokens in (int(tokens) for tokens in args.tokens.split(",")):
            memory = layer_module.compile_layer(config, mesh, num_tokens).memory_analysis()
            print(f"  experts {quantization or 'bfloat16':8}  T = {num_tokens:5}: arguments "
                  f"{memory.argument_size_in_bytes:,} bytes, temp {memory.temp_size_in_bytes:,} bytes", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
