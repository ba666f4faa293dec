"""The collectives one call of a tier issues, with their buffers in bytes and how its sums travel, read from the
tier's record: what the cost model prices and what :func:`k3_tail.select_tier`'s notes say."""

from __future__ import annotations

import dataclasses

from k3_tail.config import TailConfig
from k3_tail.ops.codecs import Codec
from k3_tail.ops.collectives import SumPlan
from k3_tail.ops.tokens import padded_token_count
from k3_tail.tiers.record import ALL_REDUCE, SUM_KINDS, CallShape
from k3_tail.tiers.registry import Tier


@dataclasses.dataclass(frozen=True)
class CollectiveBuffer:
    """One collective of a call on each rank: its kind, its buffer in bytes, whether it runs beside the GEMM, for
    a sum its codec (None: unquantised) and for an unquantised all-reduce its form (else None)."""

    kind: str
    nbytes: int
    beside_gemm: bool
    codec: Codec | None = None
    form: str | None = None


def tier_rows(config: TailConfig, tier: Tier, num_tokens: int, tp_size: int) -> int:
    """The token rows ``tier`` works on: T, or T' for sequence-parallel output and a tier that splits tokens."""
    if config.sequence_parallel or tier.record.splits_tokens:
        return padded_token_count(num_tokens, tp_size)
    return num_tokens


def collective_buffers(config: TailConfig, num_tokens: int, tp_size: int, *, tier: Tier, weight_layout: str,
                       sums: SumPlan) -> tuple[CollectiveBuffer, ...]:
    """The collectives ``tier`` issues per rank for T = ``num_tokens`` on ``tp_size`` ranks, in issue order, its
    sums travelling as ``sums`` says; none for T = 0 without sequence-parallel output (XLA drops them)."""
    if num_tokens == 0 and not config.sequence_parallel:
        return ()
    shape = CallShape(
        rows=tier_rows(config, tier, num_tokens, tp_size), latent_size=config.latent_size,
        hidden_size=config.hidden_size, tp_size=tp_size, weight_layout=weight_layout,
        has_shared=config.has_shared_experts, use_norm=config.use_latent_norm,
        routed_output_is_reduced=config.routed_output_is_reduced, token_sharded=config.sequence_parallel,
        shared_output_is_reduced=config.shared_output_is_reduced,
    )
    buffers = []
    for term in tier.record.collectives(shape):
        nbytes = config.dtype.itemsize * term.elements
        codec = sums.codec_for(nbytes) if term.kind in SUM_KINDS else None  # as the tiers decide it
        form = sums.form_for(config.dtype, nbytes) if term.kind == ALL_REDUCE and codec is None else None
        buffers.append(CollectiveBuffer(term.kind, nbytes, term.beside_gemm, codec, form))
    return tuple(buffers)
