"""The routed experts of the Kimi-K3 layer on one TP rank: three methods, and which one a call takes.

Every method computes this rank's routed latent partial

    r_i[t] = sum_j combine[t, j] * SiTU(latent[t] @ G_e, latent[t] @ U_e) @ D_e,   e = chosen[t, j]

for latent [T, L] (the layer's dtype), chosen [T, k] expert ids, combine [T, k] float32, and this rank's
blocks gate, up [E, L, m/p] and down [E, m/p, L] (each expert's intermediate width m split over the p
ranks), exactly: every (token, expert) pair, for any routing. A block may be MXFP4
(``k3_tail.models.kimi_k3.mxfp4_experts.Mxfp4Kernel``: packed codes and scales); each method decodes it exactly
(``mxfp4.dense``) where it uses the weights, and gathers blocks while they are still packed.
Each returns float32 [T, L]; GEMMs take
the dtype's operands and accumulate in float32 (the capacity method's are k3_tail.models.kimi_k3.gemm.matmul,
which multiplies a capacity of one row as two, or for MXFP4 kernels on a GPU the Pallas kernel, whose
additions run in another order: within float32 accumulation of XLA's), the SiTU output is rounded to
the dtype where it enters the down GEMM, and the k slots' outputs are summed with their weights as a
multiply and a reduce. No method issues a collective.

- "gather" (decode, T * k <= E): for each (token, slot) the chosen expert's blocks are read where they
  lie and applied as a multiply and a reduce over the gathered block, which XLA fuses into one loop:
  the [T, k, L, m/p] weight blocks are never written out. Reads T*k blocks of 3 L m/p elements; MXFP4
  blocks are decoded inside that loop, so only their codes and scales are read.
- "capacity" (prefill, T * k > E): the T*k pairs sorted by expert; each expert's first C pairs
  (:func:`expert_capacity`) in one batched GEMM over all E experts, [E, C, L] x [E, L, m/p] with the
  weights read in place, once; the pairs beyond C in overflow rounds of S = :func:`overflow_slots`
  chunks (up to C pairs of one expert each, that expert's blocks gathered for the round) until none
  is left. 6 E C L m/p FLOPs for the first pass and 6 S C L m/p per round; routing every token to the
  same k experts takes about k T / (C S) rounds: exact, but slow. MXFP4 weights are taken S experts
  at a time: the first pass runs as a loop over groups of S experts, and each round takes its S gathered
  blocks; each GEMM is ``Mxfp4Kernel.matmul``, on a GPU one Pallas kernel that decodes the codes in its
  operand load (no decoded weight is written), on the CPU XLA's GEMM of the group's decoded kernels.
  An empty slot's zero row meets its expert's weights; its output is selected away, not weighted by
  zero, so a non-finite weight reaches only the tokens that chose its expert.
- "ragged_dot": the pairs sorted by expert and one ``jax.lax.ragged_dot`` per kernel. It is the
  grouped GEMM's API, not its kernel: with jax 0.10.2 the CPU backend and XLA's default GPU pipeline
  compute it densely over all E groups, every row against every expert's weights, the other groups'
  rows masked out (E times the useful FLOPs). XLA's GPU plugin has two opt-in grouped lowerings,
  ``--xla_gpu_experimental_use_ragged_dot_fusion`` (cuDNN) and
  ``--xla_gpu_experimental_use_ragged_dot_grouped_gemm`` with ``--xla_gpu_enable_cublaslt``
  (hipBLASLt); neither is verified here (no GPU). Never selected; call it by name.

Why these. Compiled for a deviceless 8 x H100 at Kimi-K3's shapes (896 experts, top 16, L 3584,
m/p 384, bf16), the whole layer with the tail tier it selects (``python scripts/kimi_k3_layer_share.py
--parts cost``: GEMM FLOPs per device from the HLO, a while loop's body counted once, over the
layer's useful FLOPs; XLA's temp memory):

| prefill, T = 256 / 2048 / 8192 | GEMM FLOPs / useful | temp memory (GB) |
| --- | --- | --- |
| ragged_dot (the layer's method before) | 422x / 503x / 502x | 26.3 / 210.6 / 842.2 |
| tiles of 8 sorted pairs, one expert each, every tile's blocks gathered | 1.82x / 1.12x / 1.03x | 11.7 / 41.6 / 143.9 |
| the same, tiles of 32 pairs | 4.29x / 1.49x / 1.12x | 8.8 / 16.4 / 42.6 |
| capacity, factor 1.0, S = E/8 | 1.11x / 1.08x / 1.07x | 0.94 / 1.00 / 2.05 |
| capacity, factor 1.25, S = E/4 | 1.30x / 1.32x / 1.32x | 1.88 / 1.97 / 2.54 |
| capacity, factor 1.25, S = E/8 | 1.22x / 1.23x / 1.23x | 0.94 / 1.00 / 2.54 |
| **capacity, factor 1.25, S = E/16 (this module)** | **1.19x / 1.19x / 1.18x** | **0.48 / 0.66 / 2.54** |
| capacity, factor 1.5, S = E/8 | 1.34x / 1.39x / 1.39x | 0.95 / 1.01 / 3.04 |

A tiled grouped GEMM in plain JAX takes each tile's weight blocks as an operand, so it copies at
least E blocks (7.4 GB per device here) however the tiles are sized; the capacity dispatch reads
every expert's weights in place and copies only one round's S blocks. The compiled count holds one
overflow round; how many run depends on the routing. Under uniform random routing (a numpy
simulation of top 16 of 896) a factor of 1.0 puts C at the mean load and runs about 4 rounds at
T = 2048 and 8192, where 1.25 runs about one: hence 1.25, with the smallest S measured (its rounds
copy the fewest blocks). Decode, T = 1 / 16: the gather method needs 0.4 / 7 MB of temp memory,
against 88 / 1413 MB for the einsums over gathered [T, k, L, m/p] blocks it replaces (XLA copied
those blocks, transposed).

:func:`routed_expert_method` picks by T and says why.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from k3_tail.models.kimi_k3.gemm import matmul
from k3_tail.models.kimi_k3.mxfp4_experts import Mxfp4Kernel, dense
from k3_tail.models.kimi_k3.situ import situ

# Capacity per expert over the mean pairs per expert, T*k/E: pairs beyond it go to overflow rounds.
CAPACITY_FACTOR = 1.25
# Overflow chunks per round, as a share of E: the chunks' weight blocks are gathered (copied), so this
# bounds that copy; rounds repeat until every chunk is done.
OVERFLOW_SLOTS_PER_EXPERT = 1 / 16


@dataclasses.dataclass(frozen=True)
class RoutedExpertMethod:
    """The method a call takes (a key of :data:`ROUTED_EXPERTS`) and why."""

    method: str
    reason: str


def routed_expert_method(config, num_tokens: int) -> RoutedExpertMethod:
    """For a ``LayerConfig`` (the layer imports this module): ``config.routed_experts`` when it names a method;
    else "gather" while T * k <= E (it reads at most
    the E blocks all experts hold, with no sort), "capacity" above (each expert's weights read once).
    ValueError for a negative T."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens: expected an integer >= 0, got {num_tokens!r}")
    if config.routed_experts is not None:
        return RoutedExpertMethod(config.routed_experts,
                                  f"forced by LayerConfig(routed_experts={config.routed_experts!r})")
    pairs, experts = num_tokens * config.top_k, config.num_experts
    if pairs <= experts:
        return RoutedExpertMethod("gather", f"T*k = {pairs} <= E = {experts}: each pair's expert blocks read in "
                                            f"place, {pairs} blocks")
    capacity = expert_capacity(num_tokens, config.top_k, experts)
    return RoutedExpertMethod("capacity", f"T*k = {pairs} > E = {experts}: every expert's weights read once "
                                          f"for its first {capacity} pairs, the rest in overflow rounds")


def expert_capacity(num_tokens: int, top_k: int, num_experts: int) -> int:
    """C, the pairs each expert takes in the capacity method's first pass: ceil(CAPACITY_FACTOR * T*k / E),
    at least 1 and at most T (the most a router choosing k distinct experts per token gives one expert)."""
    return max(1, min(num_tokens, math.ceil(CAPACITY_FACTOR * num_tokens * top_k / num_experts)))


def overflow_slots(num_experts: int) -> int:
    """S, the overflow chunks one round of the capacity method takes: E * OVERFLOW_SLOTS_PER_EXPERT, at least 1."""
    return max(1, math.ceil(num_experts * OVERFLOW_SLOTS_PER_EXPERT))


def experts_by_gather(latent, chosen, combine, gate, up, down) -> jax.Array:
    """This rank's routed partial [T, L] float32 (module docstring), each pair's blocks read in place.

    Per (token, slot) the products are formed as multiply + reduce over the gathered blocks, in float32
    (a product of two bf16 values is exact there, as in a GEMM accumulating in float32), so XLA fuses
    gather, multiply and reduce. 6 T k L m/p FLOPs, T*k blocks read; the largest arrays written are
    [T, k, m/p] and [T, k, L] float32.
    """
    rows = latent.astype(jnp.float32)[:, None, :]                                   # [T, 1, L]
    gate_in = _products(rows, gate[chosen])                                         # [T, k, m/p]
    up_in = _products(rows, up[chosen])
    activation = situ(gate_in, up_in).astype(latent.dtype).astype(jnp.float32)
    out = _products(activation, down[chosen])                                       # [T, k, L]
    return _weighted_sum(combine, out)


def _products(rows: jax.Array, blocks: jax.Array | Mxfp4Kernel) -> jax.Array:
    """sum over K of rows[t, j, K] * blocks[t, j, K, N] in float32: rows [T, k or 1, K] float32, blocks gathered
    [T, k, K, N] -> [T, k, N], as a multiply and a reduce. MXFP4 blocks are decoded by group
    (``Mxfp4Kernel.decode_by_group``) and reduced over the group axes, which adds in the same order and lets XLA
    fuse the gather of the codes into the reduction instead of copying them."""
    if isinstance(blocks, Mxfp4Kernel):
        values = blocks.decode_by_group(jnp.float32)                                # [T, k, K/32, 16, 2, N]
        grouped = rows.reshape(*rows.shape[:-1], *values.shape[-4:-1], 1)
        return (grouped * values).sum(axis=(-4, -3, -2))
    return (rows[..., None] * blocks.astype(jnp.float32)).sum(axis=-2)


def experts_by_capacity(latent, chosen, combine, gate, up, down) -> jax.Array:
    """This rank's routed partial [T, L] float32 (module docstring), by capacity dispatch and overflow rounds.

    A chunk is up to C consecutive pairs of one expert in the expert-sorted order (C =
    :func:`expert_capacity`). The first pass takes chunk 0 of every expert with the weights in place:
    [E, C, L] rows, 6 E C L m/p FLOPs. Each overflow round takes the next S = :func:`overflow_slots`
    chunks beyond the first, their experts' blocks gathered ([S, L, m/p] per kernel), 6 S C L m/p
    FLOPs; a ``jax.lax.fori_loop`` runs ceil(chunks / S) rounds, none when no expert has more than C
    pairs. Outputs are weighted and added into their tokens' rows (a scatter-add: on a GPU its float
    additions may land in any order).
    """
    num_tokens, top_k = chosen.shape
    num_experts = gate.shape[0]
    if num_tokens == 0:
        return jnp.zeros((0, latent.shape[1]), jnp.float32)
    capacity = expert_capacity(num_tokens, top_k, num_experts)
    slots = overflow_slots(num_experts)
    order, counts = _sort_pairs(chosen, num_experts)
    starts = jnp.cumsum(counts) - counts
    token_of_pair, combine_of_pair = order // top_k, combine.reshape(-1)[order]

    def add_chunks(result, experts, offsets, gate_blocks, up_blocks, down_blocks):
        """result + the outputs of the chunks of ``experts`` [S] starting ``offsets`` [S] pairs into each
        expert's pairs (an offset at or past the expert's count leaves the chunk empty)."""
        within = offsets[:, None] + jnp.arange(capacity)                            # [S, C]
        present = within < counts[experts][:, None]
        pair = jnp.where(present, starts[experts][:, None] + within, 0)
        token, weight = token_of_pair[pair], combine_of_pair[pair]
        rows = jnp.where(present[..., None], latent[token], 0)                      # [S, C, L]
        out = _expert_mlp(rows, gate_blocks, up_blocks, down_blocks)
        # A select, not a zero weight: an empty slot's zero row times a non-finite weight of its expert is NaN, and
        # 0 * NaN would put it into the row of the token the slot points at, which never chose that expert.
        contribution = jnp.where(present[..., None], weight[..., None] * out, 0.0)
        return result.at[token.reshape(-1)].add(contribution.reshape(-1, out.shape[-1]))

    result = jnp.zeros(latent.shape, jnp.float32)
    if isinstance(gate, Mxfp4Kernel):
        # Decoded S experts at a time, each group's codes right before its GEMMs, so that no more than one group's
        # decoded kernels (3 S L m/p values) exist at once; the last group starts at E - S, its experts that an
        # earlier group took left empty. Arrays are read in place by one GEMM over all E.
        def first_pass_group(index, result):
            start = jnp.minimum(index * slots, num_experts - slots)
            experts = start + jnp.arange(slots)
            offsets = jnp.where(experts >= index * slots, 0, counts[experts])
            return add_chunks(result, experts, offsets, *(kernel.experts(start, slots) for kernel in (gate, up, down)))

        # The first group outside the loop: under shard_map its result varies over the ranks, as the loop's carry must.
        result = jax.lax.fori_loop(1, -(-num_experts // slots), first_pass_group, first_pass_group(0, result))
    else:
        result = add_chunks(result, jnp.arange(num_experts), jnp.zeros(num_experts, counts.dtype), gate, up, down)

    extra_chunks = jnp.maximum(-(-counts // capacity) - 1, 0)                       # per expert, beyond chunk 0
    chunk_ends = jnp.cumsum(extra_chunks)

    def overflow_round(round_index, result):
        chunk = round_index * slots + jnp.arange(slots)
        expert = jnp.minimum(jnp.searchsorted(chunk_ends, chunk, side="right", method="compare_all"), num_experts - 1)
        chunk_in_expert = chunk - (chunk_ends[expert] - extra_chunks[expert]) + 1     # 1 for its second chunk
        offsets = jnp.where(chunk < chunk_ends[-1], chunk_in_expert * capacity, counts[expert])
        return add_chunks(result, expert, offsets, *(_select(kernel, expert) for kernel in (gate, up, down)))

    rounds = -(-chunk_ends[-1] // slots)
    return jax.lax.fori_loop(0, rounds, overflow_round, result)


def experts_by_ragged_dot(latent, chosen, combine, gate, up, down) -> jax.Array:
    """This rank's routed partial [T, L] float32 (module docstring): the T*k pairs sorted by expert, one
    ``jax.lax.ragged_dot`` per kernel, the pairs' outputs put back in token order and weighted.

    The largest intermediates are [T*k, L] and [T*k, m/p]; FLOPs as the lowering computes them
    (module docstring: E times 6 T k L m/p where it is dense).
    """
    num_tokens, top_k = chosen.shape
    order, group_sizes = _sort_pairs(chosen, gate.shape[0])
    rows = latent[order // top_k]
    gate, up, down = (dense(kernel, latent.dtype) for kernel in (gate, up, down))
    gate_in = jax.lax.ragged_dot(rows, gate, group_sizes, preferred_element_type=jnp.float32)
    up_in = jax.lax.ragged_dot(rows, up, group_sizes, preferred_element_type=jnp.float32)
    activation = situ(gate_in, up_in).astype(latent.dtype)
    out = jax.lax.ragged_dot(activation, down, group_sizes, preferred_element_type=jnp.float32)
    out = out[jnp.argsort(order)].reshape(num_tokens, top_k, latent.shape[1])  # back to (token, slot) order
    return _weighted_sum(combine, out)


# The methods by name, each (latent, chosen, combine, gate, up, down) -> this rank's partial [T, L] float32.
ROUTED_EXPERTS = {"gather": experts_by_gather, "capacity": experts_by_capacity, "ragged_dot": experts_by_ragged_dot}


def _sort_pairs(chosen: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order [T*k]: the flat (token, slot) pairs in expert order, stable; counts [E] int32: pairs per expert)."""
    expert_of_pair = chosen.reshape(-1)
    order = jnp.argsort(expert_of_pair, stable=True)
    return order, jnp.bincount(expert_of_pair, length=num_experts).astype(jnp.int32)


def _weighted_sum(combine: jax.Array, out: jax.Array) -> jax.Array:
    """sum_j combine[t, j] * out[t, j]: combine [T, k] float32, out [T, k, L] float32 -> [T, L], as a multiply
    and a reduce over the k slots (what XLA makes of it as a dot too: one side has no free dimension)."""
    return (combine[..., None] * out).sum(axis=1)


def _expert_mlp(rows: jax.Array, gate, up, down) -> jax.Array:
    """SiTU(rows @ gate, rows @ up) @ down per expert: rows [S, C, L], gate and up [S, L, m/p], down
    [S, m/p, L] (arrays, or MXFP4 multiplied by ``Mxfp4Kernel.matmul``) -> [S, C, L] float32."""
    activation = situ(_grouped_product(rows, gate), _grouped_product(rows, up)).astype(rows.dtype)
    return _grouped_product(activation, down)


def _select(kernel: jax.Array | Mxfp4Kernel, experts: jax.Array) -> jax.Array | Mxfp4Kernel:
    """The kernels of ``experts`` [S]: an array's gathered (a copy of S blocks), MXFP4 ones selected where they lie."""
    return kernel.select(experts) if isinstance(kernel, Mxfp4Kernel) else kernel[experts]


def _grouped_product(rows: jax.Array, kernel: jax.Array | Mxfp4Kernel) -> jax.Array:
    """rows [S, C, K] @ kernel [S, K, N] in float32, the products in the rows' dtype."""
    return kernel.matmul(rows) if isinstance(kernel, Mxfp4Kernel) else matmul(rows, kernel.astype(rows.dtype))
