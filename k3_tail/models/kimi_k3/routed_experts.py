"""The routed experts of the Kimi-K3 layer on one TP rank: three methods, and which one a call takes.

Every method computes this rank's routed latent partial, float32 [T, L],

    r_i[t] = sum_j combine[t, j] * SiTU(latent[t] @ G_e, latent[t] @ U_e) @ D_e,   e = chosen[t, j]

for latent [T, L] (the layer's dtype), chosen [T, k] expert ids, combine [T, k] float32 and this rank's blocks
gate, up [E, L, m/p] and down [E, m/p, L] (arrays, or :class:`Mxfp4Kernel` decoded exactly where used), for any
routing: GEMMs take the dtype's operands and accumulate in float32, and SiTU's output is rounded to the dtype
before the down GEMM. No method issues a collective.

- "gather" (decode, T * k <= E): each pair's blocks read where they lie, as a multiply and a reduce that XLA
  fuses (no [T, k, L, m/p] copy); 6 T k L m/p FLOPs.
- "capacity" (prefill, T * k > E): each expert's first C pairs (:func:`expert_capacity`) in one batched GEMM
  over all E experts, 6 E C L m/p FLOPs, the rest in overflow rounds of S = :func:`overflow_slots` chunks,
  6 S C L m/p FLOPs each (about k T / (C S) rounds when every token picks the same k experts).
- "ragged_dot": one ``jax.lax.ragged_dot`` per kernel, which jax 0.10.2 lowers densely over all E groups on
  CPU and in XLA's default GPU pipeline (E times the FLOPs). Never selected; call it by name.

The compiled figures of each: docs/measurements/2026-12-01-routed-experts.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from k3_tail.models.kimi_k3.gemm import matmul
from k3_tail.models.kimi_k3.mxfp4_experts import Mxfp4Kernel, dense
from k3_tail.models.kimi_k3.situ import situ

# Capacity per expert over the mean pairs per expert, T*k/E: pairs beyond it go to overflow rounds. Under uniform
# routing 1.0 runs about 4 rounds at T = 2048 and 8192, 1.25 about one.
CAPACITY_FACTOR = 1.25
# Overflow chunks per round, as a share of E: it bounds the copy of the chunks' gathered weight blocks.
OVERFLOW_SLOTS_PER_EXPERT = 1 / 16


@dataclasses.dataclass(frozen=True)
class RoutedExpertMethod:
    """The method a call takes (a key of :data:`ROUTED_EXPERTS`) and why."""

    method: str
    reason: str


def routed_expert_method(config, num_tokens: int) -> RoutedExpertMethod:
    """For a ``LayerConfig``: ``config.routed_experts`` when it names a method, else "gather" while T * k <= E,
    "capacity" above. ValueError for a negative T."""
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
    """C, the pairs each expert takes in the capacity method's first pass: ceil(CAPACITY_FACTOR * T*k / E) in
    [1, T]."""
    return max(1, min(num_tokens, math.ceil(CAPACITY_FACTOR * num_tokens * top_k / num_experts)))


def overflow_slots(num_experts: int) -> int:
    """S, the overflow chunks one round of the capacity method takes: E * OVERFLOW_SLOTS_PER_EXPERT, at least 1."""
    return max(1, math.ceil(num_experts * OVERFLOW_SLOTS_PER_EXPERT))


def experts_by_gather(latent, chosen, combine, gate, up, down) -> jax.Array:
    """This rank's routed partial [T, L] float32 (module docstring), each pair's blocks read in place; the
    largest arrays written are [T, k, m/p] and [T, k, L] float32."""
    # Multiply + reduce in float32 (a product of two bf16 values is exact there), which XLA fuses with the gather.
    rows = latent.astype(jnp.float32)[:, None, :]                                   # [T, 1, L]
    gate_in = _products(rows, gate[chosen])                                         # [T, k, m/p]
    up_in = _products(rows, up[chosen])
    activation = situ(gate_in, up_in).astype(latent.dtype).astype(jnp.float32)
    out = _products(activation, down[chosen])                                       # [T, k, L]
    return _weighted_sum(combine, out)


def _products(rows: jax.Array, blocks: jax.Array | Mxfp4Kernel) -> jax.Array:
    """rows [T, k or 1, K] float32 times gathered blocks [T, k, K, N], summed over K in float32 -> [T, k, N]."""
    if isinstance(blocks, Mxfp4Kernel):
        # Reduced over the group axes, in the same order, so XLA fuses the codes' gather into the reduction.
        values = blocks.decode_by_group(jnp.float32)                                # [T, k, K/32, 16, 2, N]
        grouped = rows.reshape(*rows.shape[:-1], *values.shape[-4:-1], 1)
        return (grouped * values).sum(axis=(-4, -3, -2))
    return (rows[..., None] * blocks.astype(jnp.float32)).sum(axis=-2)


def experts_by_capacity(latent, chosen, combine, gate, up, down) -> jax.Array:
    """This rank's routed partial [T, L] float32 (module docstring), by capacity dispatch and overflow rounds.

    A chunk is up to C consecutive pairs of one expert in expert order. The first pass takes chunk 0 of every
    expert, weights in place; each overflow round the next S chunks, their blocks gathered ([S, L, m/p] per
    kernel). Outputs are scatter-added into their tokens' rows (on a GPU in any order).
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
        """result + the outputs of the chunks of ``experts`` [S] starting ``offsets`` [S] pairs into each (at or
        past the expert's count: an empty chunk)."""
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
        # S experts at a time, so at most one group's decoded kernels exist; the last group starts at E - S, its
        # experts that an earlier group took left empty.
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
    """This rank's routed partial [T, L] float32 (module docstring), by one ``jax.lax.ragged_dot`` per kernel
    over the pairs sorted by expert."""
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
    """sum_j combine[t, j] * out[t, j]: combine [T, k] float32, out [T, k, L] float32 -> [T, L]."""
    return (combine[..., None] * out).sum(axis=1)


def _expert_mlp(rows: jax.Array, gate, up, down) -> jax.Array:
    """SiTU(rows @ gate, rows @ up) @ down per expert: rows [S, C, L], gate and up [S, L, m/p], down
    [S, m/p, L] (arrays or MXFP4) -> [S, C, L] float32."""
    activation = situ(_grouped_product(rows, gate), _grouped_product(rows, up)).astype(rows.dtype)
    return _grouped_product(activation, down)


def _select(kernel: jax.Array | Mxfp4Kernel, experts: jax.Array) -> jax.Array | Mxfp4Kernel:
    """The kernels of ``experts`` [S]: an array's gathered (a copy of S blocks), MXFP4 ones selected where they lie."""
    return kernel.select(experts) if isinstance(kernel, Mxfp4Kernel) else kernel[experts]


def _grouped_product(rows: jax.Array, kernel: jax.Array | Mxfp4Kernel) -> jax.Array:
    """rows [S, C, K] @ kernel [S, K, N] in float32, the products in the rows' dtype."""
    return kernel.matmul(rows) if isinstance(kernel, Mxfp4Kernel) else matmul(rows, kernel.astype(rows.dtype))
