"""The native tier: vLLM's base path and the reference semantics of the tail."""

from __future__ import annotations

import jax

from k3_tail._checks import AxisName
from k3_tail.config import TailConfig
from k3_tail.ops.columns import project_all_columns
from k3_tail.ops.norm import allreduce_norm_latent_out
from k3_tail.tiers.record import CallShape, CollectiveTerm, TierRecord
from k3_tail.ops.tokens import add_shared, own_tokens, shared_output


def native_tail(
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
    """AR(r); scale; norm; GEMM; AR(s); add, in that order. Runs inside ``jax.shard_map``.

    Per rank: routed_partial [T, L], shared_partial [T, H] or None, norm_weight [L] or None,
    up_proj_kernel [L, H] ("replicated") or this rank's [L, Hb] block ("column").
    Returns y [T, H] in ``config.dtype``, identical on every rank; for sequence-parallel output
    (T % p == 0) this rank's [T/p, H] rows, AR(s) then being a reduce-scatter over tokens. With
    ``config.shared_output_is_reduced`` shared_partial is the reduced shared output
    (:func:`k3_tail.reduce_shared`'s form), added without a collective.

    Cost per rank, replicated layout: 2TLH GEMM FLOPs, 2LH weight bytes, AR(T*L) and AR(T*H).
    Column layout: 2TLH/p FLOPs and 2LH/p weight bytes, plus an all-gather of the [T, H/p] output
    blocks. The collectives are issued serially; XLA's scheduler may still reorder or combine them.
    On ``platform`` "rocm" the shared output is added after the GEMM, never in it
    (:func:`k3_tail.ops.tokens.add_shared`).
    """
    latent = allreduce_norm_latent_out(routed_partial, norm_weight, config=config, axis_name=axis_name,
                                       platform=platform)
    projected = project_all_columns(
        latent, up_proj_kernel, hidden_size=config.hidden_size, weight_layout=weight_layout, axis_name=axis_name,
        fp8_activations=config.fp8_activations,
    )
    if config.sequence_parallel:
        projected = own_tokens(projected, axis_name=axis_name)
    shared = None
    if shared_partial is not None:
        shared = shared_output(shared_partial, axis_name=axis_name, config=config, platform=platform)
    return add_shared(projected, shared, config=config, platform=platform)


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    shared = (CollectiveTerm(shape.output_reduction, shape.rows * shape.hidden_size),) if shape.sums_shared else ()
    return shape.latent_reduction() + shape.column_gather() + shared


RECORD = TierRecord(
    name="native",
    function=native_tail,
    summary="vLLM's base path and the reference semantics: every step after the one before it",
    schedule="AR(r); norm; GEMM; AR(s); add",
    collectives_text="AR(TL), AR(TH) (column layout: + AG(TH) of the output blocks)",
    projects_all_columns=True,
    token_sharded_form="AR(s) becomes a reduce-scatter over tokens and each rank keeps its rows of the projection",
    shared_reduced_form="AR(s) is left out: the reduced shared output is added",
    collectives=_collectives,
)
