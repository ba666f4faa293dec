"""The token-parallel tier (vLLM's ROCm prefill tail): every collective splits tokens, none reduces whole.

The routed latent is reduce-scattered over tokens (half an all-reduce's bytes), each rank
RMS-normalises and projects only its own T/p rows with the whole kernel, and the shared partial is
reduce-scattered over tokens to meet them. Token-sharded output ends there; replicated output
all-gathers the rows. Per rank that moves RS(T*L) + RS(T*H) (+ AG(T*H)): a quarter fewer bytes than
the column tier's token-sharded form AR(T*L) + RS(T*H) at Kimi-K3's L = H/2, a sixth fewer than its
AR(T*L) + AR(T*H) for replicated output, at the column tier's GEMM FLOPs (2TLH/p). Not for decode:
every rank needs the whole kernel, and T/p rows of a small T leave the GEMM nothing to do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName
from k3_tail.config import TailConfig
from k3_tail.ops.collectives import reduce_scatter
from k3_tail.ops.norm import rms_norm
from k3_tail.ops.up_projection import project
from k3_tail.tiers.record import ALL_GATHER, REDUCE_SCATTER, CallShape, CollectiveTerm, TierRecord
from k3_tail.ops.scopes import LATENT_REDUCTION, SHARED_REDUCTION
from k3_tail.ops.tokens import add_shared, gather_tokens, own_tokens, pad_tokens


def token_parallel_tail(
    routed_partial: jax.Array,
    shared_partial: jax.Array | None,
    norm_weight: jax.Array | None,
    up_proj_kernel: jax.Array,
    *,
    config: TailConfig,
    axis_name: AxisName,
    weight_layout: str,
    platform: str | None = None,
) -> jax.Array:
    """RS(r) over tokens; norm of the own rows; RS(s) over tokens; own rows @ W + s; [AG over tokens].

    Inside ``jax.shard_map``. Per rank: routed_partial [T, L] (unreduced), shared_partial [T, H] or
    None, norm_weight [L] or None, up_proj_kernel [L, H]: the whole kernel ("replicated" layout), since
    each rank projects its rows onto every column. T need not divide by p: the rows are padded with
    zeros to T' = a multiple of p (zero rows stay zero through the norm) and sliced off again.

    Returns y [T, H] in ``config.dtype``, identical on every rank; for sequence-parallel output this
    rank's [T/p, H] rows (then T % p == 0), with no all-gather at all. ``platform``: this tier
    issues no all-reduce whose form it could choose; on "rocm" the shared rows are added after the
    GEMM, never in it (:func:`k3_tail.ops.tokens.add_shared`).

    Cost per rank: 2(T'/p)LH GEMM FLOPs, 2LH weight bytes, RS(T'*L), RS(T'*H) and, for replicated
    output, AG(T'*H). With ``config.shared_output_is_reduced`` shared_partial is the reduced shared
    output (:func:`k3_tail.reduce_shared`'s form): no RS(T'*H), the rank takes its own rows of it.
    """
    RECORD.check_runs(weight_layout, config)
    num_tokens = routed_partial.shape[0]
    if num_tokens == 0:  # nothing to split (sequence-parallel output arrives padded to p rows)
        return jnp.zeros((0, config.hidden_size), config.dtype)
    tp_size = lax.axis_size(axis_name)

    def own_rows(x, scope):
        with jax.named_scope(scope):
            return reduce_scatter(pad_tokens(x, tp_size), axis_name=axis_name, config=config, scatter_dimension=0)

    weight = norm_weight if config.use_latent_norm else None
    latent = rms_norm(own_rows(routed_partial, LATENT_REDUCTION), weight, eps=config.rms_norm_eps,
                      scale=config.routed_scaling_factor)
    y = project(latent.astype(config.dtype), up_proj_kernel, fp8_activations=config.fp8_activations)
    shared = None
    if shared_partial is not None:
        if not config.shared_output_is_reduced:
            shared = own_rows(shared_partial, SHARED_REDUCTION)
        elif config.sequence_parallel:
            shared = shared_partial  # already this rank's rows
        else:
            shared = own_tokens(pad_tokens(shared_partial, tp_size), axis_name=axis_name)
    y = add_shared(y, shared, config=config, platform=platform)
    if config.sequence_parallel:
        return y
    return gather_tokens(y, num_tokens, axis_name=axis_name)


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    terms = [CollectiveTerm(REDUCE_SCATTER, shape.rows * shape.latent_size)]
    if shape.sums_shared:
        terms.append(CollectiveTerm(REDUCE_SCATTER, shape.rows * shape.hidden_size))
    if not shape.token_sharded:
        terms.append(CollectiveTerm(ALL_GATHER, shape.rows * shape.hidden_size))
    return tuple(terms)


RECORD = TierRecord(
    name="token_parallel",
    function=token_parallel_tail,
    summary="vLLM's ROCm prefill tail: routed and shared partials reduce-scattered over tokens; each rank "
            "normalises and projects its own T/p rows with the whole kernel",
    schedule="RS(r) over tokens; norm of own rows; RS(s) over tokens; own rows GEMM + add; AG over tokens "
             "(replicated output only)",
    collectives_text="RS(TL), RS(TH), + AG(TH) for replicated output",
    projects_all_columns=True,
    shards_tokens=True,
    token_sharded_form="the final all-gather over tokens is left out: each rank keeps its own rows",
    shared_reduced_form="RS(s) is left out: each rank takes its own rows of the reduced shared output",
    collectives=_collectives,
    needs_whole_kernel=True,
    needs_unreduced_routed=True,
)
