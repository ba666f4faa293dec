"""One GPU kernel (Pallas, Triton backend) for the tail's local work, with its float32 reference
:func:`norm_project_add_reference`: for rank k of p and own columns C = [k*Hb, (k+1)*Hb) cut at H,

    y[:, C] = round( RMSNorm_g(c * x) @ W[:, C] + a[:, C] )        (float32 inside, one rounding)

with :func:`k3_tail.ops.norm.rms_norm`'s overflow-safe contract (finite x: finite y; NaN and infinity: NaN).

K is split too, to fill a GPU: program (r, j, s) multiplies row tile r, column tile j and slab s of K, scaled by
the power of two at or above the slab's largest magnitude; the last of a tile's S programs (an atomic counter)
rescales the partials exactly to the row's largest, sums them in slab order and finishes the row.
``serial_split=True`` sums them in one program per tile: the split's result bit for bit, its ordering's oracle.

Memory ordering (tests/test_memory_ordering.py reads it from the machine code): a program's stores of its partial
and exponent must be visible to the tile's last program before it loads them. On NVIDIA a program is 4 warps:
``bar.sync``, thread 0's ``atom.acq_rel.gpu`` on the counter, ``bar.sync`` (PTX's cumulativity through the
barrier). On AMD a release or an acquire orders only its own wavefront, and a workgroup barrier completes no other
wavefront's stores, so a program is ONE wavefront (:func:`warps_per_program`): the atomic's ``buffer_wbl2`` /
``s_waitcnt vmcnt(0)`` release and ``buffer_inv`` acquire then cover every store and load of the program.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from k3_tail.hardware import GPU_VENDOR_PLATFORMS
from k3_tail.ops.columns import column_block_width
from k3_tail.ops.float_bits import decode_fp8, exponent_at_or_above, power_of_two
from k3_tail.ops.fused_launch import (
    COLUMN_TILE,
    COUNTER_STRIDE,
    K_STEP,
    TARGET_PROGRAMS,
    FusedGrid,
    fused_grid,
    warps_per_program,
)
from k3_tail.ops.gpu_only import gpu_only
from k3_tail.ops.norm import rms_norm, row_scale_floor
from k3_tail.ops.pallas_triton import dot_precision, ignore_triton_deprecation_warning, interpreted, vary_alike
from k3_tail.ops.scopes import GEMM_FLOPS_KEY
from k3_tail.ops.up_projection import QuantizedKernel

_PALLAS_TRITON = "jax.experimental.pallas.triton"


@functools.cache  # asked by every why_not of the tier; a failed import would search the path again each time
def triton_unavailable() -> str | None:
    """Why the kernel cannot be built with this jax (its Pallas Triton backend cannot be imported), or None."""
    try:
        importlib.import_module(_PALLAS_TRITON)
    except ImportError as error:  # a jax without the backend (deprecated since jax 0.11)
        return f"this jax ({jax.__version__}) has no Pallas Triton backend ({_PALLAS_TRITON}: {error})"
    return None


@dataclasses.dataclass(frozen=True)
class BlockProjection:
    """The static parameters of :func:`norm_project_add` and of its reference: p, H, and the norm's epsilon and c
    (norm_is_computable holds for them)."""

    tp_size: int
    hidden_size: int
    eps: float
    scale: float

    @property
    def block_width(self) -> int:
        """Hb = padded_hidden_size(H, p) / p."""
        return column_block_width(self.hidden_size, self.tp_size)


def norm_project_add(
    latent: jax.Array,
    norm_weight: jax.Array | None,
    kernel: jax.Array | QuantizedKernel,
    addend: jax.Array | None,
    *,
    rank: jax.Array,
    projection: BlockProjection,
    interpret: bool,
    platform: str | None = None,
    target_programs: int | None = None,
    serial_split: bool = False,
) -> jax.Array:
    """This rank's [T, Hb] block ``round(RMSNorm_g(scale * latent) @ W[:, C] + addend[:, C])`` in the latent's
    dtype, in one kernel; its columns past H are zero.

    Args:
      latent, norm_weight: x [T, L] in the activation dtype (bf16 or float32); g [L], or None (``scale * x``,
        rounded to the activation dtype, is projected).
      kernel: the whole [L, H] kernel or this rank's [L, Hb] block, in the latent's dtype or a QuantizedKernel;
        read where it lies, never copied.
      addend: [T, Wa] (Wa >= H) in the latent's dtype whose columns C are added, or None.
      rank: int32 [1], k in [0, p); a traced index outside touches no memory outside the arrays and gives NaN
        in the first block's columns.
      projection: p, H, the norm's epsilon and c.
      interpret, platform, serial_split: Pallas's interpret mode; the platform it compiles for; see above.
      target_programs: the grid's aim (1: no split of K; None: :data:`TARGET_PROGRAMS` compiled, 1 interpreted).

    Cost: 2*L*Hb weight bytes (L*Hb for FP8), T*L latent values read about twice, 2*T*L*Hb FLOPs,
    :meth:`FusedGrid.scratch_bytes` of scratch, one kernel launch (and when S > 1 a memcpy of the counters).
    """
    if latent.shape[0] == 0:
        return jnp.zeros((0, projection.block_width), latent.dtype)
    kernel_options = dict(interpret=interpret, platform=platform, target_programs=target_programs,
                          serial_split=serial_split)
    return _with_reference_gradient(False, latent, norm_weight, kernel, addend, rank, projection, kernel_options)


def norm_project_add_into(
    latent: jax.Array,
    norm_weight: jax.Array | None,
    kernel: jax.Array | QuantizedKernel,
    addend: jax.Array,
    *,
    rank: jax.Array,
    projection: BlockProjection,
    **kernel_options,
) -> jax.Array:
    """``addend`` [T, Wa] with its columns C below H replaced by :func:`norm_project_add`'s (its keywords), the
    output aliasing ``addend``. Cost: :func:`norm_project_add`'s."""
    if addend is None:
        raise ValueError("addend: expected the [T, W] array to write into, got None")
    if latent.shape[0] == 0:
        return addend
    return _with_reference_gradient(True, latent, norm_weight, kernel, addend, rank, projection, kernel_options)


def _with_reference_gradient(into_addend: bool, latent, norm_weight, kernel, addend, rank,
                             projection: BlockProjection, kernel_options: dict) -> jax.Array:
    """The kernel's result with the reference's derivatives: Pallas differentiates no kernel writing its input."""
    reference = norm_project_add_into_reference if into_addend else norm_project_add_reference

    @jax.custom_jvp
    def fused(latent, norm_weight, kernel, addend, rank):
        return _fused_call(latent, norm_weight, kernel, addend, into_addend=into_addend, rank=rank,
                           projection=projection, **kernel_options)

    @fused.defjvp
    def _derivative(primals, tangents):
        *values, rank = primals
        _, derivative = jax.jvp(lambda *values: reference(*values, rank=rank, projection=projection), tuple(values),
                                tangents[:-1])
        return fused(*primals), derivative

    return fused(latent, norm_weight, kernel, addend, rank)


def _fused_call(latent, norm_weight, kernel, addend, *, into_addend: bool, rank, projection: BlockProjection,
                interpret, platform=None, target_programs=None, serial_split=False):
    # Pallas is loaded with the first call only: `import k3_tail` stays light, and a jax without it imports.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    if not interpret:  # jax 0.12 warns when the user's program lowers the kernel (k3_tail.ops.pallas_triton)
        ignore_triton_deprecation_warning()
    num_tokens, latent_size = latent.shape
    dtype = latent.dtype
    block_width, eps, scale = projection.block_width, projection.eps, projection.scale
    if target_programs is None:
        target_programs = 1 if interpret else TARGET_PROGRAMS
    grid = fused_grid(num_tokens, latent_size, block_width, target_programs=target_programs)
    communicates = grid.splits > 1 and not serial_split
    quantized = isinstance(kernel, QuantizedKernel)
    values = kernel.values if quantized else kernel
    use_norm = norm_weight is not None and scale != 0
    spec = _KernelSpec(
        grid=grid, num_tokens=num_tokens, latent_size=latent_size, tp_size=projection.tp_size, block_width=block_width,
        hidden_size=projection.hidden_size, scale=float(scale), sqrt_eps=math.sqrt(eps / scale**2) if use_norm else 0.0,
        # Without the norm the slabs are only scaled down (2^e >= 1): the products of huge latents and FP8
        # codes stay finite until the column scale; ordinary latents are multiplied as they are.
        floor_exponent=int(math.log2(row_scale_floor(eps, scale, latent_size))) if use_norm else 0,
        kernel_offset=values.shape[1] != block_width,  # the whole kernel: C starts at rank * Hb
        fp8_format=jnp.dtype(values.dtype).name if quantized else None, into_addend=into_addend,
        communicates=communicates, barriers=not interpret,
    )
    # The kernel's inputs in its signature's order, None where absent. FP8 values travel as their bytes (a free
    # bitcast), decoded in the kernel: Pallas's Triton lowering casts from no float8_e4m3fnuz (MI300X's format).
    inputs = (rank.astype(jnp.int32).reshape(1), latent, norm_weight if use_norm else None,
              lax.bitcast_convert_type(values, jnp.uint8) if quantized else values,
              kernel.scale if quantized else None, addend,
              jnp.asarray(_counter_starts(grid.rows * grid.columns)) if communicates else None)
    present = [array for array in inputs if array is not None]
    output = jax.ShapeDtypeStruct(addend.shape if into_addend else (num_tokens, block_width), dtype)
    scratch = (jax.ShapeDtypeStruct(inputs[-1].shape, jnp.int32),
               jax.ShapeDtypeStruct((grid.splits, num_tokens, grid.columns * COLUMN_TILE), jnp.float32),
               jax.ShapeDtypeStruct((grid.splits, grid.columns, num_tokens), jnp.int32)) if communicates else None
    # Indices among the inputs passed: the output writes into the addend, the counters count in place.
    def passed_index(position):
        return sum(array is not None for array in inputs[:position])

    aliases = {passed_index(_ADDEND_INPUT): 0} if into_addend else {}
    if communicates:
        aliases[passed_index(_COUNTER_STARTS_INPUT)] = 1

    def run(arrays):
        """The pallas_call on the present ``arrays``, its outputs varying as they do."""
        arrays, varying = vary_alike(arrays)

        def typed(shape):
            return jax.ShapeDtypeStruct(shape.shape, shape.dtype, manual_axis_type=varying)

        out_shape = (typed(output), None if scratch is None else tuple(typed(s) for s in scratch))

        def kernel_call(*arrays):
            arrays = iter(arrays)
            placed = [None if array is None else next(arrays) for array in inputs]
            return pl.pallas_call(
                functools.partial(_kernel, spec=spec, pl=pl, plt=plt),
                out_shape=out_shape,
                grid=(grid.rows, grid.columns, grid.splits if communicates else 1),
                input_output_aliases=aliases,
                interpret=interpret,
                compiler_params=plt.CompilerParams(num_warps=warps_per_program(platform)),
                name="k3_tail_norm_project_add",
                # The product's FLOPs, which the compiled program's custom call carries for k3_tail.xla.report.
                metadata={GEMM_FLOPS_KEY: str(2 * num_tokens * latent_size * block_width)},
            )(*placed)[:1]

        if interpret:
            return kernel_call(*arrays)[0]
        warps = {gpu: warps_per_program(gpu) for gpu in GPU_VENDOR_PLATFORMS}  # the lowering platform's
        return gpu_only(kernel_call, *arrays, platform=platform, num_warps=warps)[0]

    # Pallas's interpreter takes no values typed as varying over a shard_map's axes: interpreted() gathers them.
    return interpreted(run, present) if interpret else run(present)


# Positions of the kernel's inputs that outputs alias (its signature's order).
_ADDEND_INPUT, _COUNTER_STARTS_INPUT = 5, 6


@dataclasses.dataclass(frozen=True)
class _KernelSpec:
    """What the kernel body is specialised on (static): the grid, the sizes and the modes of one call."""

    grid: FusedGrid
    num_tokens: int
    latent_size: int
    tp_size: int
    block_width: int
    hidden_size: int
    scale: float
    sqrt_eps: float  # sqrt(eps) / |c| with the norm, else 0
    floor_exponent: int  # the smallest slab exponent: log2 of rms_norm's row-scale floor, 0 without the norm
    kernel_offset: bool
    fp8_format: str | None
    into_addend: bool  # the output is the addend with the rank's columns replaced (else the [T, Hb] block)
    communicates: bool  # S > 1 slabs in S programs, summed by the last (else in the tile's one program)
    barriers: bool  # the GPU's: interpret mode runs programs in turn


def _kernel(rank_ref, latent_ref, norm_weight_ref, values_ref, column_scale_ref, addend_ref, counter_starts_ref,
            out_ref, scratch_refs, *, spec: _KernelSpec, pl, plt):
    """Program (r, j, s) of :func:`norm_project_add`; absent inputs are None. scratch_refs: (counters, float32
    partials [S, T, J*16], int32 exponents [S, J, T]) when the split communicates."""
    del counter_starts_ref  # the counters' starts: their ref is the counters' output, aliased
    grid = spec.grid
    use_norm = norm_weight_ref is not None
    r, j = pl.program_id(0), pl.program_id(1)
    rank = plt.load(rank_ref.at[jnp.zeros((1,), jnp.int32)])[0]  # the [1] block, then its scalar
    # Every access below is masked by rank_ok: a rank outside [0, p) reads and writes nothing of another's.
    rank_ok = (rank >= 0) & (rank < spec.tp_size)
    rows = r * grid.row_tile + jnp.arange(grid.row_tile)
    row_ok = rows < spec.num_tokens
    tile_columns = j * COLUMN_TILE + jnp.arange(COLUMN_TILE)
    global_columns = rank * spec.block_width + tile_columns
    column_ok = (tile_columns < spec.block_width) & (global_columns < spec.hidden_size) & rank_ok
    kernel_columns = global_columns if spec.kernel_offset else tile_columns
    steps = grid.split_depth // K_STEP

    def latent_tile(step):
        ks = step * K_STEP + jnp.arange(K_STEP)
        mask = row_ok[:, None] & (ks < spec.latent_size)[None, :]
        return ks, plt.load(latent_ref.at[rows[:, None], ks[None, :]], mask=mask, other=0.0).astype(jnp.float32)

    def slab_exponent(slab):
        """e_s per row: 2^e_s at or above the slab's largest magnitude, in [floor, 126] (126 for NaN, infinity)."""
        def body(step, largest):
            _, x = latent_tile(slab * steps + step)
            return jnp.maximum(largest, jnp.max(jnp.abs(x), axis=1))
        largest = lax.fori_loop(0, steps, body, jnp.zeros((grid.row_tile,), jnp.float32))
        return exponent_at_or_above(largest, spec.floor_exponent)

    def slab_partial(slab, exponent):
        inverse_scale = power_of_two(-exponent)[:, None]

        def body(step, partial):
            ks, x = latent_tile(slab * steps + step)
            if use_norm:
                g = plt.load(norm_weight_ref.at[ks], mask=ks < spec.latent_size, other=0.0).astype(jnp.float32)
                operand = x * inverse_scale * g[None, :]
            else:
                operand = x * inverse_scale * spec.scale  # round(c x) 2^-e, exactly: a power of two
            mask = (ks < spec.latent_size)[:, None] & column_ok[None, :]
            # Operands in the activation dtype, as every tier's GEMM has them (FP8 is exact in it); float32 sums.
            w = plt.load(values_ref.at[ks[:, None], kernel_columns[None, :]], mask=mask, other=0)
            w = (decode_fp8(w, spec.fp8_format) if spec.fp8_format else w).astype(latent_ref.dtype)
            return partial + jnp.dot(operand.astype(latent_ref.dtype), w, preferred_element_type=jnp.float32,
                                     precision=dot_precision(latent_ref.dtype))

        return lax.fori_loop(0, steps, body, jnp.zeros((grid.row_tile, COLUMN_TILE), jnp.float32))

    def finish(projected, row_exponent):
        """Row scale, column scale, the add, one rounding, the store of ``projected`` (scaled by 2^-row_exponent)."""
        inverse_scale = power_of_two(-row_exponent)
        if use_norm:
            def squares(step, total):
                _, x = latent_tile(step)
                return total + jnp.sum(jnp.square(x * inverse_scale[:, None]), axis=1)

            total = lax.fori_loop(0, pl.cdiv(spec.latent_size, K_STEP), squares,
                                  jnp.zeros((grid.row_tile,), jnp.float32))
            epsilon_term = jnp.square(spec.sqrt_eps * inverse_scale)
            factor = lax.rsqrt(total / spec.latent_size + epsilon_term)
            projected = projected * (factor if spec.scale > 0 else -factor)[:, None]
        if spec.fp8_format:
            projected = projected * plt.load(column_scale_ref.at[kernel_columns], mask=column_ok, other=0.0)[None, :]
        if not use_norm:
            # Back to the latent's own scale, after the column scale: finite wherever the result is.
            projected = projected * power_of_two(row_exponent)[:, None]
        mask = row_ok[:, None] & column_ok[None, :]
        out_columns = global_columns if spec.into_addend else tile_columns
        if addend_ref is not None:
            addend = plt.load(addend_ref.at[rows[:, None], global_columns[None, :]], mask=mask, other=0.0)
            projected = projected + addend.astype(jnp.float32)
        store_mask = mask if spec.into_addend else row_ok[:, None] & (tile_columns < spec.block_width)[None, :]
        projected = jnp.where(column_ok[None, :], projected, 0.0)
        # A rank outside [0, p): NaN over the first block's columns instead, which the output always has.
        first_block_ok = (tile_columns < spec.block_width) & (tile_columns < spec.hidden_size)
        first_block = row_ok[:, None] & first_block_ok[None, :]
        projected = jnp.where(rank_ok, projected, jnp.nan)
        out_columns = jnp.where(rank_ok, out_columns, tile_columns)
        store_mask = jnp.where(rank_ok, store_mask, first_block)
        plt.store(out_ref.at[rows[:, None], out_columns[None, :]], projected.astype(out_ref.dtype), mask=store_mask)

    def combine(exponent_of, partial_of):
        """The tile's S slabs summed in slab order, each rescaled exactly to the row's largest exponent E."""
        row_exponent = lax.fori_loop(0, grid.splits, lambda slab, e: jnp.maximum(e, exponent_of(slab)),
                                     jnp.full((grid.row_tile,), spec.floor_exponent, jnp.int32))

        def rescaled(slab, acc):
            # 2^(e_s - E) <= 1: exact, or zero below float32's normals (a slab 2^126 below the row's largest).
            exponent = exponent_of(slab)
            return acc + partial_of(slab, exponent) * power_of_two(exponent - row_exponent)[:, None]

        finish(lax.fori_loop(0, grid.splits, rescaled, jnp.zeros((grid.row_tile, COLUMN_TILE), jnp.float32)),
               row_exponent)

    if not spec.communicates:
        combine(slab_exponent, slab_partial)
        return

    # Publish this slab's partial and exponent, then count it; the tile's last slab finishes it. The barriers
    # extend the acquire-release atomic to every thread of an NVIDIA program (module docstring).
    counter_ref, partial_ref, exponent_ref = scratch_refs
    s = pl.program_id(2)
    exponent = slab_exponent(s)
    valid_rows = row_ok[:, None]
    plt.store(partial_ref.at[s, rows[:, None], tile_columns[None, :]], slab_partial(s, exponent), mask=valid_rows)
    plt.store(exponent_ref.at[s, j, rows], exponent, mask=row_ok)
    if spec.barriers:
        plt.debug_barrier()
    counter = (r * grid.columns + j) * COUNTER_STRIDE
    done_before = plt.atomic_add(counter_ref, (counter,), jnp.int32(1)) - _counter_start(counter)
    if spec.barriers:
        plt.debug_barrier()

    @pl.when(done_before == grid.splits - 1)
    def _():
        combine(lambda slab: plt.load(exponent_ref.at[slab, j, rows], mask=row_ok, other=spec.floor_exponent),
                lambda slab, _: plt.load(partial_ref.at[slab, rows[:, None], tile_columns[None, :]],
                                         mask=valid_rows, other=0.0))


# The counters start at (w mod M) * A mod M, not at zero: XLA writes a constant of equal values (or an iota) with
# a kernel, but copies any other constant in with a memcpy, which launches no kernel.
_START_MULTIPLIER, _START_MODULUS = 7919, 65521


def _counter_starts(count: int) -> np.ndarray:
    """The counters of ``count`` tiles, int32 [count * COUNTER_STRIDE]: tile t's is word t * COUNTER_STRIDE."""
    words = np.arange(count * COUNTER_STRIDE, dtype=np.int64)
    return (words % _START_MODULUS * _START_MULTIPLIER % _START_MODULUS).astype(np.int32)


def _counter_start(word):
    return word % _START_MODULUS * _START_MULTIPLIER % _START_MODULUS


def norm_project_add_reference(
    latent: jax.Array,
    norm_weight: jax.Array | None,
    kernel: jax.Array | QuantizedKernel,
    addend: jax.Array | None,
    *,
    rank: jax.Array,
    projection: BlockProjection,
) -> jax.Array:
    """:func:`norm_project_add` in plain float32 jnp, [T, Hb], for a ``rank`` (int32 [1]) in [0, p)."""
    dtype, block_width, scale = latent.dtype, projection.block_width, projection.scale
    weights = kernel.dequantize() if isinstance(kernel, QuantizedKernel) else jnp.asarray(kernel, jnp.float32)
    start = rank.astype(jnp.int32).reshape(())[()] * block_width
    own = start + jnp.arange(block_width) < projection.hidden_size
    if weights.shape[1] != block_width:  # the whole kernel: the rank's columns, zero past H
        weights = lax.dynamic_slice_in_dim(_padded_columns(weights, block_width), start, block_width, 1)
    normed = rms_norm(latent, norm_weight if scale != 0 else None, eps=projection.eps, scale=scale)
    if norm_weight is None or scale == 0:
        normed = normed.astype(dtype).astype(jnp.float32)
    projected = jnp.dot(normed, weights, precision=lax.Precision.HIGHEST)
    if addend is not None:
        own_addend = lax.dynamic_slice_in_dim(_padded_columns(addend, block_width), start, block_width, 1)
        projected = projected + own_addend.astype(jnp.float32)
    return jnp.where(own, projected, 0.0).astype(dtype)


def norm_project_add_into_reference(latent, norm_weight, kernel, addend: jax.Array, *, rank: jax.Array,
                                    projection: BlockProjection) -> jax.Array:
    """:func:`norm_project_add_into` in plain float32 jnp."""
    block = norm_project_add_reference(latent, norm_weight, kernel, addend, rank=rank, projection=projection)
    block_width = projection.block_width
    start = rank.astype(jnp.int32).reshape(())[()] * block_width
    width = addend.shape[1]
    padded = _padded_columns(addend, block_width)
    own = lax.dynamic_slice_in_dim(padded, start, block_width, 1)
    keep = start + jnp.arange(block_width) < projection.hidden_size
    padded = lax.dynamic_update_slice_in_dim(padded, jnp.where(keep, block, own), start, 1)
    return padded[:, :width]


def _padded_columns(x: jax.Array, block_width: int) -> jax.Array:
    """``x`` [R, W] (W >= H) with ``block_width`` zero columns after it, so a dynamic slice of a rank's block never
    clips."""
    return jnp.pad(x, [(0, 0), (0, block_width)])
