"""Token-sharded (sequence-parallel) output: the last collective of a tier scatters tokens.

With ``TailConfig(sequence_parallel=True)`` a tier returns rank k's rows [k*T/p, (k+1)*T/p) of y
instead of all of y: the final all-reduce of [T, H] becomes a reduce-scatter over tokens (half the
wire bytes: (p-1)/p * 2TH instead of 2(p-1)/p * 2TH), an all-gather over columns becomes an
all-to-all, and a replicated intermediate is cut to the own rows. The tier functions need T % p == 0
per rank; :func:`k3_tail.latent_moe_tail` pads the token dimension with zero rows (whose outputs
are zero, since RMSNorm of a zero row is zero; at least p rows, also for T = 0). JAX arrays shard
evenly only, so when p does not divide T (or T = 0) it gathers the padded rows and returns the T
rows replicated instead (:func:`is_token_sharded_output` says which a call gets).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName
from k3_tail.config import TailConfig
from k3_tail.ops.collectives import all_reduce, reduce_scatter
from k3_tail.ops.scopes import OUTPUT_GATHER, SHARED_REDUCTION
from k3_tail.ops.up_projection import outside_gemm


def padded_token_count(num_tokens: int, tp_size: int) -> int:
    """The rows a tier works on for sequence-parallel output: the smallest multiple of ``tp_size``
    that is >= ``num_tokens``, and at least ``tp_size`` (a reduce-scatter cannot split zero rows)."""
    return max(-(-num_tokens // tp_size), 1) * tp_size


def pad_tokens(x: jax.Array, tp_size: int) -> jax.Array:
    """``x`` [T, W] with zero rows appended up to ``padded_token_count(T, tp_size)``, so that a
    reduce-scatter over tokens gives every rank T'/p rows (no copy when T already is a multiple)."""
    padding = padded_token_count(x.shape[0], tp_size) - x.shape[0]
    return jnp.pad(x, [(0, padding), (0, 0)]) if padding else x


def is_token_sharded_output(config: TailConfig, num_tokens: int, tp_size: int) -> bool:
    """Whether a call with T = ``num_tokens`` on ``tp_size`` ranks returns y token-sharded (rank k
    holding rows [k*T/p, (k+1)*T/p)): with ``config.sequence_parallel``, T > 0 and p dividing T.
    Otherwise every rank returns all T rows (replicated)."""
    return config.sequence_parallel and num_tokens > 0 and num_tokens % tp_size == 0


def reduce_output(x: jax.Array, *, axis_name: AxisName, config: TailConfig, platform: str | None,
                  scope: str) -> jax.Array:
    """Sum of ``x`` [T, W] over the ranks: all of it ([T, W], an all-reduce in the form ``config``
    picks on ``platform``) or, for sequence-parallel output, this rank's [T/p, W] rows of it
    (reduce-scatter over tokens; :mod:`k3_tail.ops.collectives` for both). The collectives carry
    the named scope ``scope`` (:mod:`k3_tail.ops.scopes`: what they sum)."""
    with jax.named_scope(scope):
        if config.sequence_parallel:
            return reduce_scatter(x, axis_name=axis_name, config=config, scatter_dimension=0)
        return all_reduce(x, axis_name=axis_name, config=config, platform=platform)


def shared_output(shared_partial: jax.Array, *, axis_name: AxisName, config: TailConfig,
                  platform: str | None) -> jax.Array:
    """The sum of the shared partials in the form of this rank's output: [T, W], or this rank's [T/p, W]
    rows for sequence-parallel output.

    With ``config.shared_output_is_reduced`` the argument already is that sum
    (:func:`k3_tail.reduce_shared`) and is returned as it is: no collective. Otherwise
    :func:`reduce_output` of the partials, named ``k3_tail/shared_reduction``.
    """
    if config.shared_output_is_reduced:
        return shared_partial
    return reduce_output(shared_partial, axis_name=axis_name, config=config, platform=platform,
                         scope=SHARED_REDUCTION)


def add_shared(projected: jax.Array, shared: jax.Array | None, *, config: TailConfig,
               platform: str | None) -> jax.Array:
    """y = projected + shared, added in float32 and rounded once to ``config.dtype`` (``projected`` alone,
    rounded, when there is no shared output). The one place where a tier's projection meets the shared
    output: on ``platform`` "rocm" the add never goes inside the GEMM (:func:`outside_gemm`)."""
    if shared is None:
        return projected.astype(config.dtype)
    projected = outside_gemm(projected, platform=platform)
    return (projected.astype(jnp.float32) + shared.astype(jnp.float32)).astype(config.dtype)


def own_tokens(x: jax.Array, *, axis_name: AxisName) -> jax.Array:
    """This rank's [T/p, W] rows of a [T, W] array that every rank holds whole (no communication)."""
    rows = x.shape[0] // lax.axis_size(axis_name)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * rows, rows, axis=0)


def gather_tokens(rows: jax.Array, num_tokens: int, *, axis_name: AxisName) -> jax.Array:
    """The first ``num_tokens`` rows of the token-sharded [T'/p, W] ``rows`` on every rank: an
    all-gather over tokens of (p-1)/p * T'W elements, then the padding rows sliced off."""
    with jax.named_scope(OUTPUT_GATHER):
        return lax.all_gather(rows, axis_name, axis=0, tiled=True, to="invarying")[:num_tokens]
