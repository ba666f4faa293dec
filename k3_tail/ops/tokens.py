"""Token rows: the padding of T to T' = :func:`padded_token_count` (JAX arrays shard evenly only; a zero row's
output is zero) and a rank's own rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName, check_int
from k3_tail.ops.scopes import OUTPUT_GATHER


def padded_token_count(num_tokens: int, tp_size: int) -> int:
    """T', the rows a tier works on for sequence-parallel output: the smallest multiple of p = ``tp_size`` at or
    above T = ``num_tokens``, at least p (a reduce-scatter cannot split zero rows).

    Raises:
      ValueError: naming the argument, unless ``num_tokens`` is an integer >= 0 and ``tp_size`` one >= 1.
    """
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    return max(-(-num_tokens // tp_size), 1) * tp_size


def pad_tokens(x: jax.Array, tp_size: int) -> jax.Array:
    """``x`` [T, W] zero-padded to ``padded_token_count(T, tp_size)`` rows."""
    padding = padded_token_count(x.shape[0], tp_size) - x.shape[0]
    return jnp.pad(x, [(0, padding), (0, 0)]) if padding else x


def own_tokens(x: jax.Array, *, axis_name: AxisName) -> jax.Array:
    """This rank's [T/p, W] rows of a [T, W] array that every rank holds whole (no communication)."""
    rows = x.shape[0] // lax.axis_size(axis_name)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * rows, rows, axis=0)


def gather_tokens(rows: jax.Array, num_tokens: int, *, axis_name: AxisName) -> jax.Array:
    """The first ``num_tokens`` rows of the token-sharded [T'/p, W] ``rows``, on every rank (an all-gather)."""
    with jax.named_scope(OUTPUT_GATHER):
        return lax.all_gather(rows, axis_name, axis=0, tiled=True, to="invarying")[:num_tokens]
