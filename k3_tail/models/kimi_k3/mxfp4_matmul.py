"""A batched GEMM over MXFP4 kernels, y[s] = rows[s] @ decode(packed[e[s]], scale[e[s]]), decoded in the operand
load of one GPU kernel (Pallas, Triton backend) that never writes a decoded weight, and its reference.

Why a kernel: XLA fuses no decode into its GEMM's operand load, so it writes the decoded kernels and reads them back
(docs/kimi_k3.md, "MXFP4 routed experts"). Program (s, j, i) takes kernel e[s]'s column tile j and row tile i and
walks K one group of 32 rows at a time, building the values' bits with integer operations (exact whatever the
GPU's float modes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from k3_tail._checks import describe
from k3_tail.models.kimi_k3.mxfp4 import CODES_PER_BYTE, DECODED_DTYPES, GROUP_SIZE, STORED_DTYPE, decode, value_bits
from k3_tail.ops.gpu_only import gpu_only
from k3_tail.ops.pallas_triton import dot_precision, ignore_triton_deprecation_warning, interpreted, vary_alike

# Columns of one program's tile: 128 bytes of float32 output a row, 64 packed bytes of one group row.
BLOCK_COLUMNS = 64
# Warps (wavefronts) a program: its programs share nothing, so the vendors' memory models ask nothing of it.
WARPS = 4
# Row tiles: at least 16 (the matrix instructions' smallest M), at most 64.
SMALLEST_ROW_TILE, LARGEST_ROW_TILE = 16, 64
# A group's rows of K held by one byte row each: 16 bytes of two codes.
_GROUP_BYTES = GROUP_SIZE // CODES_PER_BYTE
_FLOAT32_MANTISSA_BITS = 23
_INT32 = np.iinfo(np.int32)


def row_tile(num_rows: int) -> int:
    """The rows one program takes: the power of two at or above C, within 16 .. 64."""
    return min(LARGEST_ROW_TILE, max(SMALLEST_ROW_TILE, 1 << max(num_rows - 1, 0).bit_length()))


def mxfp4_matmul(rows: jax.Array, packed: jax.Array, scale: jax.Array, *, kernels: jax.Array | None = None,
                 interpret: bool = False) -> jax.Array:
    """rows[s] @ decode(packed[kernels[s]], scale[kernels[s]]) for each of S kernels, in one GPU kernel.

    Args:
      rows: [S, C, K], bfloat16 or float32: the products' dtype, accumulated in float32 (in another order than XLA's).
      packed, scale: uint8 [E, K/2, N] and [E, K/32, N] (:func:`.mxfp4.decode`'s layout).
      kernels: integers [S], which of the E kernels each row block multiplies, read where they lie (no copy of
        their codes); None for all, in order (S = E). An index outside [0, E), judged in its own dtype, gives that
        block NaN and touches no memory outside the arrays; a concrete index int32 cannot hold is refused.
      interpret: run in Pallas's interpret mode (a CPU has no Triton); inside a ``jax.shard_map`` with
        ``check_vma=True`` each device computes every device's call (:func:`k3_tail.ops.pallas_triton.interpreted`).

    Returns:
      float32 [S, C, N]. NaN and inf weights reach the outputs that multiply them, as in the decoded kernel's
      GEMM. K = 0 or E = 0 gives 0 where the block's index is a kernel, NaN where it is not, as the reference.

    Differentiable with respect to ``rows`` (reverse mode only: the reference's gradient, through XLA's GEMM).

    Cost: the S kernels' packed bytes (0.53 a weight) read once per row tile, the rows once per column tile;
    2 S C K N FLOPs; one kernel launch, no scratch.

    Raises:
      ValueError: naming the argument, for non-arrays, shapes that do not pair, other dtypes, a concrete index
        int32 cannot hold, or a non-bool ``interpret``.
    """
    kernels = _check(rows, packed, scale, kernels)
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret: expected True or False, got {interpret!r}")
    batch, num_rows, depth = rows.shape
    num_kernels, columns = packed.shape[0], packed.shape[-1]
    if 0 in (batch, num_rows, columns):
        return jnp.zeros((batch, num_rows, columns), jnp.float32)
    if 0 in (depth, num_kernels):
        return _empty_sum(rows, num_kernels, columns, kernels)
    return _product(rows, packed, scale, kernels, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _product(rows: jax.Array, packed: jax.Array, scale: jax.Array, kernels: jax.Array | None,
             interpret: bool) -> jax.Array:
    """:func:`mxfp4_matmul` of checked, non-empty operands: the pallas_call."""
    from jax.experimental import pallas as pl  # loaded with the first call: `import k3_tail` stays light
    from jax.experimental.pallas import triton as plt

    if not interpret:  # jax 0.12 warns when the user's program lowers the kernel (k3_tail.ops.pallas_triton)
        ignore_triton_deprecation_warning()
    batch, num_rows, depth = rows.shape
    columns = packed.shape[-1]
    block_rows = row_tile(num_rows)

    def run(inputs):
        inputs, varying = vary_alike(inputs)
        out_shape = jax.ShapeDtypeStruct((batch, num_rows, columns), jnp.float32, manual_axis_type=varying)
        call = pl.pallas_call(
            functools.partial(_kernel, indexed=kernels is not None, block_rows=block_rows, pl=pl, plt=plt),
            out_shape=out_shape,
            grid=(batch, pl.cdiv(columns, BLOCK_COLUMNS), pl.cdiv(num_rows, block_rows)),
            interpret=interpret,
            # Triton's parameters choose its backend (jax 0.10 would take Mosaic GPU on NVIDIA without them).
            compiler_params=plt.CompilerParams(num_warps=WARPS),
            name="k3_tail_mxfp4_matmul",
        )
        # Compiled, lowered for the GPUs only: a multi-platform program holds it in its GPUs' branch.
        return call(*inputs) if interpret else gpu_only(lambda *inputs: (call(*inputs),), *inputs)[0]

    # Indices, not a slice or gather of the kernels, which XLA would copy before the custom call. Without indices
    # the call takes no index array (XLA would make an iota of them a kernel of its own).
    inputs = [rows, packed, scale] if kernels is None else [kernels, rows, packed, scale]
    return interpreted(run, inputs) if interpret else run(inputs)


def _product_forward(rows, packed, scale, kernels, interpret):
    return _product(rows, packed, scale, kernels, interpret), (rows, packed, scale, kernels)


def _product_backward(interpret, residuals, cotangent):
    """The reference's VJP with respect to the rows."""
    rows, packed, scale, kernels = residuals
    _, rows_vjp = jax.vjp(lambda x: mxfp4_matmul_reference(x, packed, scale, kernels=kernels), rows)
    return (*rows_vjp(cotangent), None, None, None)


_product.defvjp(_product_forward, _product_backward)


def _empty_sum(rows: jax.Array, num_kernels: int, columns: int, kernels: jax.Array | None) -> jax.Array:
    """float32 [S, C, N] of K = 0 or E = 0: 0, the empty sum, in each block whose index is a kernel, else NaN."""
    batch, num_rows, _ = rows.shape
    blocks = jnp.arange(batch) if kernels is None else kernels
    is_kernel = (blocks >= 0) & (blocks < num_kernels)
    return jnp.broadcast_to(jnp.where(is_kernel, 0.0, jnp.nan).astype(jnp.float32)[:, None, None],
                            (batch, num_rows, columns))


def _kernel(*refs, indexed, block_rows, pl, plt):
    """Program (s, j, i): rows tile i of block s times its kernel's column tile j, group by group."""
    kernels_ref, rows_ref, packed_ref, scale_ref, out_ref = refs if indexed else (None, *refs)
    num_rows, depth = rows_ref.shape[1:]
    num_kernels, columns = packed_ref.shape[0], packed_ref.shape[-1]
    s, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kernel = plt.load(kernels_ref.at[s + jnp.zeros((1,), jnp.int32)])[0] if indexed else s  # [1], then its scalar
    kernel_ok = (kernel >= 0) & (kernel < num_kernels)
    kernel = jnp.where(kernel_ok, kernel, 0)  # a bad index reads kernel 0 and is answered with NaN below
    row = i * block_rows + jnp.arange(block_rows)
    column = j * BLOCK_COLUMNS + jnp.arange(BLOCK_COLUMNS)
    row_ok, column_ok = row < num_rows, column < columns
    dtype = rows_ref.dtype

    def group_product(group, acc):
        byte_rows = group * _GROUP_BYTES + jnp.arange(_GROUP_BYTES)
        # Masked columns read code 0 under scale 0: the value 0, so they add nothing (and are not stored).
        codes = plt.load(packed_ref.at[kernel, byte_rows[:, None], column[None, :]], mask=column_ok[None, :],
                         other=0).astype(jnp.int32)
        exponents = plt.load(scale_ref.at[kernel, group, column], mask=column_ok, other=0).astype(jnp.int32)[None, :]
        for nibble in range(CODES_PER_BYTE):  # the low codes are K's even rows of the group, the high ones its odd
            bits = value_bits((codes >> (4 * nibble)) & 0xF, exponents, _FLOAT32_MANTISSA_BITS)
            weights = lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)  # exact: 2 significant bits
            ks = group * GROUP_SIZE + CODES_PER_BYTE * jnp.arange(_GROUP_BYTES) + nibble
            x = plt.load(rows_ref.at[s, row[:, None], ks[None, :]], mask=row_ok[:, None], other=0)
            acc = acc + jnp.dot(x, weights, preferred_element_type=jnp.float32, precision=dot_precision(dtype))
        return acc

    acc = lax.fori_loop(0, depth // GROUP_SIZE, group_product, jnp.zeros((block_rows, BLOCK_COLUMNS), jnp.float32))
    acc = jnp.where(kernel_ok, acc, jnp.nan)
    plt.store(out_ref.at[s, row[:, None], column[None, :]], acc, mask=row_ok[:, None] & column_ok[None, :])


def mxfp4_matmul_reference(rows: jax.Array, packed: jax.Array, scale: jax.Array, *,
                           kernels: jax.Array | None = None) -> jax.Array:
    """:func:`mxfp4_matmul` in plain jnp: the kernels gathered, decoded to the rows' dtype and multiplied by XLA's
    GEMM, accumulating in float32."""
    kernels = _check(rows, packed, scale, kernels)
    if packed.shape[0] == 0:  # nothing to gather: no index is a kernel
        return _empty_sum(rows, 0, packed.shape[-1], kernels)
    kernels = jnp.arange(rows.shape[0]) if kernels is None else kernels
    weights = decode(packed[kernels], scale[kernels], rows.dtype)
    product = jnp.einsum("sck,skn->scn", rows, weights, preferred_element_type=jnp.float32,
                         precision=dot_precision(rows.dtype))
    return jnp.where(((kernels >= 0) & (kernels < packed.shape[0]))[:, None, None], product, jnp.nan)


def _check(rows, packed, scale, kernels) -> jax.Array | None:
    """The indices as the kernel takes them, or ValueError naming the argument :func:`mxfp4_matmul` refuses."""
    if not hasattr(rows, "shape") or not hasattr(rows, "dtype"):
        raise ValueError(f"rows: expected an array [S, C, K] of {tuple(d.name for d in DECODED_DTYPES)}, got "
                         f"{describe(rows)}")
    if len(rows.shape) != 3 or jnp.dtype(rows.dtype) not in DECODED_DTYPES:
        raise ValueError(f"rows: expected [S, C, K] of {tuple(d.name for d in DECODED_DTYPES)}, got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    depth = rows.shape[2]
    if depth % GROUP_SIZE:
        raise ValueError(f"rows: K must be a multiple of {GROUP_SIZE} (one scale per {GROUP_SIZE} rows), got {depth}")
    for name, array, height in (("packed", packed, depth // CODES_PER_BYTE), ("scale", scale, depth // GROUP_SIZE)):
        if not hasattr(array, "shape") or not hasattr(array, "dtype"):
            raise ValueError(f"{name}: expected a uint8 array [E, {height}, N], got {describe(array)}")
        if jnp.dtype(array.dtype) != STORED_DTYPE or len(array.shape) != 3 or array.shape[1] != height:
            raise ValueError(f"{name}: expected uint8 [E, {height}, N] for rows {tuple(rows.shape)}, got "
                             f"{array.dtype} {tuple(array.shape)}")
    if tuple(scale.shape[::2]) != tuple(packed.shape[::2]):
        raise ValueError(f"scale: expected {packed.shape[0]} kernels of {packed.shape[2]} columns, packed's, got "
                         f"{tuple(scale.shape)}")
    if kernels is None:
        if packed.shape[0] != rows.shape[0]:
            raise ValueError(f"kernels: None multiplies kernel s by rows[s], so packed needs S = {rows.shape[0]} "
                             f"kernels, got {packed.shape[0]}; pass the indices of the kernels to use")
        return None
    return _kernel_indices(kernels, rows.shape[0], packed.shape[0])


def _kernel_indices(kernels, batch: int, num_kernels: int) -> jax.Array:
    """``kernels`` checked and as int32, each index outside [0, E) made -1, judged before any cast could wrap it
    onto a kernel (an int64 2^32 + 1 onto kernel 1)."""
    if not hasattr(kernels, "shape") or not hasattr(kernels, "dtype"):
        raise ValueError(f"kernels: expected integers [{batch}] (one per row block), got {describe(kernels)}")
    if tuple(kernels.shape) != (batch,) or not jnp.issubdtype(kernels.dtype, jnp.integer):
        raise ValueError(f"kernels: expected integers [{batch}] (one per row block), got {kernels.dtype} "
                         f"{tuple(kernels.shape)}")
    if jnp.iinfo(kernels.dtype).bits < 32 or jnp.dtype(kernels.dtype) == jnp.int32:
        return jnp.asarray(kernels, jnp.int32)  # exact (an int32 costs no operation)
    if not isinstance(kernels, jax.core.Tracer):
        values = np.asarray(kernels)
        outside = (values < _INT32.min) | (values > _INT32.max)
        if outside.any():
            position = int(np.argmax(outside))
            raise ValueError(f"kernels: expected indices int32 can hold (a kernel is 0 <= e < {num_kernels}), got "
                             f"{values[position]} at position {position}")
    return jnp.where((kernels >= 0) & (kernels < num_kernels), kernels, -1).astype(jnp.int32)
