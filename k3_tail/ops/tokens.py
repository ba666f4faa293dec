"""Token-sharded (sequence-parallel) output: the last collective of a tier scatters tokens.

The tier functions need T % p == 0 per rank, and JAX arrays shard evenly only, so for
sequence-parallel output :func:`k3_tail.latent_moe_tail` pads the tokens with zero rows up to
T' = :func:`padded_token_count` and returns each rank's T'/p rows of the padded output, for every T
(the padding rows' outputs are zero: RMSNorm of a zero row is zero). :func:`gather_tokens` serves a
tier that splits the tokens itself and returns whole output (token_parallel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName, check_int
from k3_tail.ops.scopes import OUTPUT_GATHER


def padded_token_count(num_tokens: int, tp_size: int) -> int:
    """The rows a tier works on for sequence-parallel output, T'.

    Args:
      num_tokens: T.
      tp_size: p.

    Returns:
      The smallest multiple of ``tp_size`` that is >= ``num_tokens``, and at least ``tp_size`` (a
      reduce-scatter cannot split zero rows).

    Raises:
      ValueError: naming the argument, unless ``num_tokens`` is an integer >= 0 and ``tp_size`` one >= 1.
    """
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    return max(-(-num_tokens // tp_size), 1) * tp_size


def pad_tokens(x: jax.Array, tp_size: int) -> jax.Array:
    """``x`` [T, W] with zero rows appended up to ``padded_token_count(T, tp_size)`` (no copy when
    T already is a multiple)."""
    padding = padded_token_count(x.shape[0], tp_size) - x.shape[0]
    return jnp.pad(x, [(0, padding), (0, 0)]) if padding else x


def own_tokens(x: jax.Array, *, axis_name: AxisName) -> jax.Array:
    """This rank's [T/p, W] rows of a [T, W] array that every rank holds whole (no communication)."""
    rows = x.shape[0] // lax.axis_size(axis_name)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * rows, rows, axis=0)


def gather_tokens(rows: jax.Array, num_tokens: int, *, axis_name: AxisName) -> jax.Array:
    """The first ``num_tokens`` rows of the token-sharded [T'/p, W] ``rows`` on every rank: an
    all-gather over tokens of (p-1)/p * T'W elements, then the padding rows sliced off."""
    with jax.named_scope(OUTPUT_GATHER):
        return lax.all_gather(rows, axis_name, axis=0, tiled=True, to="invarying")[:num_tokens]
