"""The routed experts at decode on a GPU in two Pallas (Triton) kernels, the router's top-k inside the first.

From this rank's input products P [T, W] (the router's logits in columns [0, E), z in [E, E + L)) and expert
blocks (m = the expert width over p), :func:`decode_experts` computes the gather method's routed partial:

    kernel 1, program (t, j, b): token t's top-k (sigmoid scores + bias, ties to the lower expert, as
              ``jax.lax.top_k``) recomputed from its E logits, its slot j's expert e and weight; then
              a[t, j, b-th block of m] = SiTU(z_t @ gate[e][:, block], z_t @ up[e][:, block]) in the dtype;
              program (t, j, 0) also writes e and the weight
    kernel 2, program (t, c): r[t, c-th block of L] = sum_j weight[t, j] * a[t, j] @ down[e_j][:, block]

Products are multiply-and-reduce in float32 (a decode's rows are too few for the matrix units); a NaN logit makes
the token's weights NaN. Cost per rank: the T k chosen blocks of 3 L m weights read where they lie; T k m + T L
values written; 6 T k L m FLOPs; two kernel launches, no scratch; programs share nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail.models.kimi_k3.mxfp4 import CODES_PER_BYTE, GROUP_SIZE, value_bits
from k3_tail.models.kimi_k3.mxfp4_experts import Mxfp4Kernel, kernel_arrays
from k3_tail.models.kimi_k3.situ import situ
from k3_tail.ops.gpu_only import gpu_only
from k3_tail.ops.pallas_triton import ignore_triton_deprecation_warning, interpreted, vary_alike

# Columns of an expert block one program takes: m (384 at p = 8) in 12 programs a slot, L (3584) in 112 a token.
BLOCK_COLUMNS = 32
# Rows of a block multiplied at once: a [256, 32] float32 tile a step.
BLOCK_ROWS = 256
WARPS = 4
_FLOAT32_MANTISSA_BITS = 23


def decode_experts(products: jax.Array, correction_bias: jax.Array, gate, up, down, *, num_experts: int,
                   top_k: int, dtype, layer: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """This rank's routed latent partial r_i [T, L] in ``dtype`` (module docstring), in two kernels.

    ``products`` [T, W] float32; ``gate``, ``up`` [E, L, m] and ``down`` [E, m, L] arrays of ``dtype``, or
    :class:`Mxfp4Kernel` (none selected). ``layer``: an integer scalar when every expert array is a stack's
    [N, E, ...]: that layer's blocks are read in place (a scan's slice would copy them). ``interpret``: Pallas's
    interpret mode, on any platform."""
    from jax.experimental import pallas as pl  # loaded with the first call: `import k3_tail` stays light
    from jax.experimental.pallas import triton as plt

    if not interpret:
        ignore_triton_deprecation_warning()
    num_tokens = products.shape[0]
    kernels = [kernel_arrays(kernel) for kernel in (gate, up, down)]
    width, latent_size = kernels[0][0].shape[-1], kernels[2][0].shape[-1]  # m and L: no MXFP4 packing on columns
    if num_tokens == 0:  # no program to run (an empty grid): the empty partial, typed as the products are
        return products[:, num_experts:num_experts + latent_size].astype(dtype)
    mxfp4 = isinstance(gate, Mxfp4Kernel)
    stacked = layer is not None
    params = plt.CompilerParams(num_warps=WARPS)

    def run(inputs):
        inputs, varying = vary_alike(inputs)
        products, bias, *weights = inputs
        layers = weights[:1] if stacked else []
        weights = weights[len(layers):]
        gate_up, down_arrays = weights[:2 * len(kernels[0])], weights[2 * len(kernels[0]):]

        def shape(*dims, dt):
            return jax.ShapeDtypeStruct(dims, dt, manual_axis_type=varying)

        first = pl.pallas_call(
            functools.partial(_choose_and_activate, num_experts=num_experts, top_k=top_k, latent_size=latent_size,
                              width=width, dtype=dtype, mxfp4=mxfp4, stacked=stacked, pl=pl, plt=plt),
            out_shape=(shape(num_tokens, top_k, width, dt=dtype), shape(num_tokens, top_k, dt=jnp.int32),
                       shape(num_tokens, top_k, dt=jnp.float32)),
            grid=(num_tokens, top_k, pl.cdiv(width, BLOCK_COLUMNS)), interpret=interpret, compiler_params=params,
            name="k3_tail_experts_choose_and_activate")
        second = pl.pallas_call(
            functools.partial(_project_and_sum, top_k=top_k, width=width, latent_size=latent_size, mxfp4=mxfp4,
                              stacked=stacked, pl=pl, plt=plt),
            out_shape=shape(num_tokens, latent_size, dt=dtype),
            grid=(num_tokens, pl.cdiv(latent_size, BLOCK_COLUMNS)), interpret=interpret, compiler_params=params,
            name="k3_tail_experts_project_and_sum")

        def both(products, bias, *weights):
            layers, weights = weights[:int(stacked)], weights[int(stacked):]
            activation, chosen, combine = first(products, bias, *layers, *weights[:len(gate_up)])
            return (second(activation, chosen, combine, *layers, *weights[len(gate_up):]),)

        if interpret:
            return both(products, bias, *layers, *gate_up, *down_arrays)[0]
        return gpu_only(both, products, bias, *layers, *gate_up, *down_arrays)[0]

    layer_input = [jnp.asarray(layer, jnp.int32).reshape(1)] if stacked else []
    inputs = [products, correction_bias.astype(jnp.float32), *layer_input, *kernels[0], *kernels[1], *kernels[2]]
    return interpreted(run, inputs) if interpret else run(inputs)


def _choose_and_activate(products_ref, bias_ref, *refs, num_experts, top_k, latent_size, width, dtype, mxfp4,
                         stacked, pl, plt):
    """Program (t, j, b) of the first kernel (module docstring)."""
    *weights, activation_ref, chosen_ref, combine_ref = refs
    where, weights = _layer(weights, stacked, plt)
    gate, up = (weights[:2], weights[2:]) if mxfp4 else ((weights[0],), (weights[1],))
    t, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lanes = 1 << (num_experts - 1).bit_length()  # Triton's blocks are powers of two
    expert = jnp.arange(lanes)
    valid = expert < num_experts
    logits = plt.load(products_ref.at[t, expert], mask=valid, other=0.0)
    scores = jax.nn.sigmoid(logits)
    biased = jnp.where(valid, scores + plt.load(bias_ref.at[expert], mask=valid, other=0.0), -jnp.inf)
    has_nan = jnp.max(jnp.where(valid & jnp.isnan(scores), 1, 0)) > 0
    total = jnp.float32(0.0)
    mine, my_score = jnp.int32(0), jnp.float32(0.0)
    for slot in range(top_k):  # k is small and static: each slot's pick is the largest left, the lower on ties
        best = jnp.max(biased)
        pick = jnp.minimum(jnp.min(jnp.where(biased == best, expert, lanes)), num_experts - 1).astype(jnp.int32)
        picked_score = jnp.sum(jnp.where(expert == pick, scores, 0.0))
        total = total + picked_score
        mine = jnp.where(j == slot, pick, mine)
        my_score = jnp.where(j == slot, picked_score, my_score)
        biased = jnp.where(expert == pick, -jnp.inf, biased)
    weight = my_score / total if top_k > 1 else my_score
    weight = jnp.where(has_nan, jnp.nan, weight)

    column = b * BLOCK_COLUMNS + jnp.arange(BLOCK_COLUMNS)
    column_ok = column < width

    def latent(rows, row_ok):
        z = plt.load(products_ref.at[t, num_experts + rows], mask=row_ok, other=0.0)
        return z.astype(dtype).astype(jnp.float32)

    gate_in = _product(latent, gate, (*where, mine), latent_size, column, column_ok, mxfp4, plt)
    up_in = _product(latent, up, (*where, mine), latent_size, column, column_ok, mxfp4, plt)
    plt.store(activation_ref.at[t, j, column], situ(gate_in, up_in).astype(dtype), mask=column_ok)
    first_block = (jnp.zeros((1,), jnp.int32) + b) == 0
    slot_index = j + jnp.zeros((1,), jnp.int32)
    plt.store(chosen_ref.at[t, slot_index], mine + jnp.zeros((1,), jnp.int32), mask=first_block)
    plt.store(combine_ref.at[t, slot_index], weight + jnp.zeros((1,), jnp.float32), mask=first_block)


def _project_and_sum(activation_ref, chosen_ref, combine_ref, *refs, top_k, width, latent_size, mxfp4, stacked, pl,
                     plt):
    """Program (t, c) of the second kernel (module docstring)."""
    *down, out_ref = refs
    where, down = _layer(down, stacked, plt)
    t, c = pl.program_id(0), pl.program_id(1)
    column = c * BLOCK_COLUMNS + jnp.arange(BLOCK_COLUMNS)
    column_ok = column < latent_size

    def slot(j, acc):
        index = j + jnp.zeros((1,), jnp.int32)
        expert = plt.load(chosen_ref.at[t, index])[0]
        weight = plt.load(combine_ref.at[t, index])[0]

        def activation(rows, row_ok):
            return plt.load(activation_ref.at[t, j, rows], mask=row_ok, other=0).astype(jnp.float32)

        return acc + weight * _product(activation, down, (*where, expert), width, column, column_ok, mxfp4, plt)

    acc = lax.fori_loop(0, top_k, slot, jnp.zeros((BLOCK_COLUMNS,), jnp.float32))
    plt.store(out_ref.at[t, column], acc.astype(out_ref.dtype), mask=column_ok)


def _layer(refs, stacked, plt):
    """(the leading indices of the experts' arrays: (layer,) or (), the arrays' refs) of a kernel's weight refs."""
    if not stacked:
        return (), refs
    return (plt.load(refs[0].at[jnp.zeros((1,), jnp.int32)])[0],), refs[1:]


def _product(vector, kernel, expert, depth, column, column_ok, mxfp4, plt):
    """sum over k < depth of vector(k) * kernel[*expert][k, column], float32 [BLOCK_COLUMNS]; ``kernel`` the
    block's array, or MXFP4's codes and scales; ``expert`` its leading indices."""
    steps = -(-depth // BLOCK_ROWS)

    def dense_step(step, acc):
        rows = step * BLOCK_ROWS + jnp.arange(BLOCK_ROWS)
        row_ok = rows < depth
        weights = plt.load(kernel[0].at[*expert, rows[:, None], column[None, :]],
                           mask=row_ok[:, None] & column_ok[None, :], other=0).astype(jnp.float32)
        return acc + jnp.sum(vector(rows, row_ok)[:, None] * weights, axis=0)

    def mxfp4_step(step, acc):
        packed, scale = kernel
        byte_rows = step * (BLOCK_ROWS // CODES_PER_BYTE) + jnp.arange(BLOCK_ROWS // CODES_PER_BYTE)
        byte_ok = byte_rows * CODES_PER_BYTE < depth
        mask = byte_ok[:, None] & column_ok[None, :]
        codes = plt.load(packed.at[*expert, byte_rows[:, None], column[None, :]], mask=mask, other=0).astype(jnp.int32)
        groups = byte_rows // (GROUP_SIZE // CODES_PER_BYTE)
        exponents = plt.load(scale.at[*expert, groups[:, None], column[None, :]], mask=mask, other=0).astype(jnp.int32)
        for nibble in range(CODES_PER_BYTE):  # the low codes are the even rows, the high ones the odd
            bits = value_bits((codes >> (4 * nibble)) & 0xF, exponents, _FLOAT32_MANTISSA_BITS)
            weights = lax.bitcast_convert_type(bits, jnp.float32)
            acc = acc + jnp.sum(vector(CODES_PER_BYTE * byte_rows + nibble, byte_ok)[:, None] * weights, axis=0)
        return acc

    return lax.fori_loop(0, steps, mxfp4_step if mxfp4 else dense_step, jnp.zeros((BLOCK_COLUMNS,), jnp.float32))
