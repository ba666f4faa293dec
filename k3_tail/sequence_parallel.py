"""Token-sharded (sequence-parallel) output: the last collective of a tier scatters tokens.

With ``TailConfig(sequence_parallel=True)`` a tier returns rank k's rows [k*T/p, (k+1)*T/p) of y
instead of all of y: the final all-reduce of [T, H] becomes a reduce-scatter over tokens (half the
wire bytes: (p-1)/p * 2TH instead of 2(p-1)/p * 2TH), an all-gather over columns becomes an
all-to-all, and a replicated intermediate is cut to the own rows. The tier functions need T % p == 0
per rank; :func:`k3_tail.tail_forward` pads the token dimension with zero rows (whose outputs are
zero, since RMSNorm of a zero row is zero; at least p rows, also for T = 0) and slices them off again.
"""

from __future__ import annotations

import jax
from jax import lax


def padded_token_count(num_tokens: int, tp_size: int) -> int:
    """The rows a tier works on for sequence-parallel output: the smallest multiple of ``tp_size``
    that is >= ``num_tokens``, and at least ``tp_size`` (a reduce-scatter cannot split zero rows)."""
    return max(-(-num_tokens // tp_size), 1) * tp_size


def reduce_output(x: jax.Array, *, axis_name: str, sequence_parallel: bool) -> jax.Array:
    """Sum of ``x`` [T, W] over the ranks: all of it ([T, W], AR) or, for sequence-parallel output,
    this rank's [T/p, W] rows of it (reduce-scatter over tokens)."""
    if sequence_parallel:
        return lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    return lax.psum(x, axis_name)


def own_tokens(x: jax.Array, *, axis_name: str) -> jax.Array:
    """This rank's [T/p, W] rows of a [T, W] array that every rank holds whole (no communication)."""
    rows = x.shape[0] // lax.axis_size(axis_name)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * rows, rows, axis=0)
