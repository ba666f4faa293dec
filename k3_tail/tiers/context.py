"""One call of the tail as every tier sees it: :class:`TailCall`, built once per call, and the tier signature.

A tier and the steps it shares with other tiers (the reduced and normalised latent, the sum of the
shared partials, the add of the projection and the shared output) read the call's facts from one
frozen object instead of threading the config, the axis, the weight layout and the platform through
every function.
"""

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
    """Whether a call with T = ``num_tokens`` on ``tp_size`` ranks returns y token-sharded (out_spec
    ``P(axis)``) rather than whole on every rank (``P()``).

    Token-sharded: rank k holds rows [k*T'/p, (k+1)*T'/p) of y padded to T' =
    ``padded_token_count(T, p)`` rows (T' = T when p divides T > 0; the padding rows are zero). That
    is the case exactly with ``config.sequence_parallel``, for every T and p: the output's form never
    depends on the call's size, so one out_spec serves every T.

    Raises:
      ValueError: naming the argument, for a config that is no TailConfig, T < 0 or p < 1.
    """
    check_config(config)
    check_int("num_tokens", num_tokens, minimum=0)
    check_int("tp_size", tp_size, minimum=1)
    return config.sequence_parallel


@dataclasses.dataclass(frozen=True)
class TailCall:
    """The facts of one call that the tiers read, fixed at trace time.

    config: the tail's :class:`~k3_tail.TailConfig`. axis_name: the TP axis (a name or a tuple of
    them). tp_size: p, its size. weight_layout: "replicated" or "column". platform: the platform the
    call's program is for (:mod:`k3_tail.selection.lowering`): "cpu", "cuda" or "rocm"; "gpu" for both
    GPU vendors, None for every platform, where what differs (a kernel's warps, ROCm's rule that keeps
    adds out of the GEMM) is decided as each lowers. It decides the form of the sums.
    sums: how the call's sums travel (:class:`~k3_tail.ops.collectives.SumPlan`).
    rank: this rank's index along the axis, int32 [1], where the entry point was given it, else None.
    """

    config: TailConfig
    axis_name: AxisName
    tp_size: int
    weight_layout: str
    platform: str | None
    sums: SumPlan
    rank: jax.Array | None = None

    @classmethod
    def inside_shard_map(cls, config: TailConfig, *, axis_name: AxisName, weight_layout: str,
                         platform: str | None, rank: jax.Array | None = None) -> TailCall:
        """The call of a tier traced inside ``jax.shard_map`` over ``axis_name``."""
        tp_size = lax.axis_size(axis_name)
        return cls(config, axis_name, tp_size, weight_layout, platform, config.sum_plan(tp_size, platform), rank)

    @property
    def token_sharded(self) -> bool:
        """Whether the tier returns this rank's [T/p, H] rows of y rather than all of y: with
        ``config.sequence_parallel``, for every call (the entry point has padded T to a multiple of p)."""
        return self.config.sequence_parallel

    def all_reduce(self, x: jax.Array) -> jax.Array:
        """The sum of ``x`` [T, W] over the ranks, on every rank (:func:`~k3_tail.ops.collectives.all_reduce`)."""
        return all_reduce(x, axis_name=self.axis_name, sums=self.sums)

    def reduce_scatter(self, x: jax.Array, scatter_dimension: int) -> jax.Array:
        """This rank's block of the sum of ``x`` along ``scatter_dimension``
        (:func:`~k3_tail.ops.collectives.reduce_scatter`)."""
        return reduce_scatter(x, axis_name=self.axis_name, sums=self.sums, scatter_dimension=scatter_dimension)

    def reduce_output(self, x: jax.Array, *, scope: str) -> jax.Array:
        """The sum of ``x`` [T, W] in the form of this rank's output: all of it, or for token-sharded
        output this rank's [T/p, W] rows (a reduce-scatter over tokens), under the named scope ``scope``."""
        with jax.named_scope(scope):
            if self.token_sharded:
                return self.reduce_scatter(x, scatter_dimension=0)
            return self.all_reduce(x)

    def reduced_latent(self, routed_partial: jax.Array) -> jax.Array:
        """``psum(r)`` [T, L], the same on every rank: one all-reduce of T*L elements, or the argument itself
        with ``config.routed_output_is_reduced`` (the reduced latent already)."""
        if self.config.routed_output_is_reduced:
            return routed_partial
        with jax.named_scope(LATENT_REDUCTION):
            return self.all_reduce(routed_partial)

    def normalised_latent(self, routed_partial: jax.Array, norm_weight: jax.Array | None) -> jax.Array:
        """``RMSNorm_g(c * psum(r))`` [T, L] in ``config.dtype``, the same on every rank.

        routed_partial: as :meth:`reduced_latent` takes it. Cost: that all-reduce and O(TL) elementwise
        work, which XLA fuses into the all-reduce's consumer. The norm is nonlinear per row, so it must
        see the fully reduced latent.
        """
        config = self.config
        weight = norm_weight if config.use_latent_norm else None
        normed = rms_norm(self.reduced_latent(routed_partial), weight, eps=config.rms_norm_eps,
                          scale=config.routed_scaling_factor)
        return normed.astype(config.dtype)

    def rank_index(self) -> jax.Array:
        """This rank's index k along the TP axis, int32 [1]: ``rank`` where given, else ``lax.axis_index``
        (on a GPU the partition id and a one-thread convert kernel)."""
        if self.rank is not None:
            return self.rank
        return lax.axis_index(self.axis_name).astype(jnp.int32).reshape(1)

    def project(self, latent: jax.Array, kernel: jax.Array | QuantizedKernel) -> jax.Array:
        """latent [T, L] @ kernel [L, W] in float32 (:func:`~k3_tail.ops.up_projection.project`)."""
        return project(latent, kernel, fp8_activations=self.config.fp8_activations)

    def shared_output(self, shared_partial: jax.Array) -> jax.Array:
        """The shared output in the form of this rank's output ([T, H], or its [T/p, H] rows): the
        argument itself with ``config.shared_output_is_reduced``, else the sum of the partials."""
        if self.config.shared_output_is_reduced:
            return shared_partial
        return self.reduce_output(shared_partial, scope=SHARED_REDUCTION)

    def add_shared(self, projected: jax.Array, shared: jax.Array | None) -> jax.Array:
        """y = projected + shared, added in float32 and rounded once to ``config.dtype`` (``projected``
        alone when there is no shared output). On "rocm" the add never goes inside the GEMM
        (:func:`~k3_tail.ops.up_projection.outside_gemm`)."""
        if shared is None:
            return projected.astype(self.config.dtype)
        projected = outside_gemm(projected, platform=self.platform)
        return (projected.astype(jnp.float32) + shared.astype(jnp.float32)).astype(self.config.dtype)


class TierFunction(Protocol):
    """A tier's per-rank function, run inside ``jax.shard_map`` over ``call.axis_name``.

    Per rank, in ``call.config.dtype``: routed_partial [T, L] (the reduced latent with
    ``routed_output_is_reduced``); shared_partial [T, H] or None (the reduced shared output with
    ``shared_output_is_reduced``: [T, H], or this rank's [T/p, H] rows for token-sharded output);
    norm_weight [L] or None; up_proj_kernel the whole [L, H] kernel ("replicated") or this rank's
    [L, Hb] block of the kernel padded to p*Hb columns ("column", Hb = ceil(H / p)), either one
    possibly a :class:`~k3_tail.QuantizedKernel`. With ``sequence_parallel`` p divides T (the entry
    point pads). Returns y [T, H], the same on every rank, or for token-sharded output this rank's
    [T/p, H] rows.
    """

    def __call__(self, routed_partial: jax.Array, shared_partial: jax.Array | None,
                 norm_weight: jax.Array | None, up_proj_kernel: jax.Array | QuantizedKernel,
                 call: TailCall) -> jax.Array: ...
