"""One call of the tail as every tier sees it: :class:`TailCall`, built once per call, and the tier signature."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax

from k3_tail._checks import AxisName, check_int
from k3_tail.config import TailConfig, check_config
from k3_tail.ops.collectives import SumPlan, all_reduce, reduce_scatter
from k3_tail.ops.norm import rms_norm
from k3_tail.ops.scopes import LATENT_REDUCTION, SHARED_REDUCTION
from k3_tail.ops.up_projection import QuantizedKernel, outside_gemm, project


def is_token_sharded_output(config: TailConfig, num_tokens: int, tp_size: int) -> bool:
    """Whether a call with T = ``num_tokens`` on ``tp_size`` ranks returns y token-sharded (out_spec ``P(axis)``:
    rank k holds rows [k*T'/p, (k+1)*T'/p) of y zero-padded to T' = ``padded_token_count(T, p)``) rather than
    whole (``P()``): exactly with ``config.sequence_parallel``, whatever T and p, so one out_spec serves every T.

    Raises:
      ValueError: naming the argument, for a config that is no TailConfig, T < 0 or p < 1.
    """
    check_config(config)
    check_int("num_tokens", num_tokens, minimum=0)
    check_int("tp_size", tp_size, minimum=1)
    return config.sequence_parallel


@dataclasses.dataclass(frozen=True)
class TailCall:
    """The facts of one call that the tiers read, fixed at trace time. platform: "cpu", "cuda", "rocm", "gpu" or
    None (:mod:`k3_tail.selection.lowering`). token_sharded: whether the tier returns this rank's [T/p, H] rows
    of y (``config.sequence_parallel``) rather than y. rank: this rank's index, int32 [1], where the entry point
    has it."""

    config: TailConfig
    axis_name: AxisName
    tp_size: int
    weight_layout: str
    platform: str | None
    sums: SumPlan
    token_sharded: bool
    rank: jax.Array | None = None

    @classmethod
    def inside_shard_map(cls, config: TailConfig, *, axis_name: AxisName, weight_layout: str,
                         platform: str | None, rank: jax.Array | None = None) -> TailCall:
        """The call of a tier traced inside ``jax.shard_map`` over ``axis_name``."""
        tp_size = lax.axis_size(axis_name)
        return cls(config, axis_name, tp_size, weight_layout, platform, config.sum_plan(tp_size, platform),
                   config.sequence_parallel, rank)

    def reduce_scatter(self, x: jax.Array, scatter_dimension: int) -> jax.Array:
        return reduce_scatter(x, axis_name=self.axis_name, sums=self.sums, scatter_dimension=scatter_dimension)

    def reduce_output(self, x: jax.Array, *, scope: str) -> jax.Array:
        """The sum of ``x`` [T, W] in the form of this rank's output ([T, W], or [T/p, W] rows), under ``scope``."""
        with jax.named_scope(scope):
            if self.token_sharded:
                return self.reduce_scatter(x, scatter_dimension=0)
            return all_reduce(x, axis_name=self.axis_name, sums=self.sums)

    def reduced_latent(self, routed_partial: jax.Array) -> jax.Array:
        """``psum(r)`` [T, L]: one all-reduce of T*L elements, none with ``config.routed_output_is_reduced``."""
        if self.config.routed_output_is_reduced:
            return routed_partial
        with jax.named_scope(LATENT_REDUCTION):
            return all_reduce(routed_partial, axis_name=self.axis_name, sums=self.sums)

    def normalised_latent(self, routed_partial: jax.Array, norm_weight: jax.Array | None) -> jax.Array:
        """``RMSNorm_g(c * psum(r))`` [T, L] in ``config.dtype``: :meth:`reduced_latent` and O(TL) elementwise work."""
        config = self.config
        weight = norm_weight if config.use_latent_norm else None
        normed = rms_norm(self.reduced_latent(routed_partial), weight, eps=config.rms_norm_eps,
                          scale=config.routed_scaling_factor)
        return normed.astype(config.dtype)

    def rank_index(self) -> jax.Array:
        """This rank's index k along the TP axis, int32 [1]: ``rank`` where given, else ``lax.axis_index``."""
        if self.rank is not None:
            return self.rank
        return lax.axis_index(self.axis_name).astype(jnp.int32).reshape(1)

    def project(self, latent: jax.Array, kernel: jax.Array | QuantizedKernel) -> jax.Array:
        return project(latent, kernel, fp8_activations=self.config.fp8_activations)

    def shared_output(self, shared_partial: jax.Array) -> jax.Array:
        """The shared output in the form of this rank's output (the argument itself when it arrives reduced)."""
        if self.config.shared_output_is_reduced:
            return shared_partial
        return self.reduce_output(shared_partial, scope=SHARED_REDUCTION)

    def add_shared(self, projected: jax.Array, shared: jax.Array | None) -> jax.Array:
        """y = projected + shared (or projected alone), added in float32 and rounded once to ``config.dtype``."""
        if shared is None:
            return projected.astype(self.config.dtype)
        projected = outside_gemm(projected, platform=self.platform)
        return (projected.astype(jnp.float32) + shared.astype(jnp.float32)).astype(self.config.dtype)


class TierFunction(Protocol):
    """A tier's per-rank function, run inside ``jax.shard_map`` over ``call.axis_name``.

    Per rank, in ``call.config.dtype``: routed_partial [T, L]; shared_partial [T, H] or None (reduced with
    ``shared_output_is_reduced``: [T, H], or [T/p, H] rows for token-sharded output); norm_weight [L] or None;
    up_proj_kernel [L, H] ("replicated") or this rank's [L, Hb] block ("column", Hb = ceil(H / p)), either
    possibly a :class:`~k3_tail.QuantizedKernel`; with ``sequence_parallel`` p divides T (the entry point pads).
    Returns y [T, H], or this rank's [T/p, H] rows for token-sharded output.
    """

    def __call__(self, routed_partial: jax.Array, shared_partial: jax.Array | None,
                 norm_weight: jax.Array | None, up_proj_kernel: jax.Array | QuantizedKernel,
                 call: TailCall) -> jax.Array: ...
