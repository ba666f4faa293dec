"""The Flax NNX module: a thin shell that owns the tail's weights and calls ``tail_forward``."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from k3_tail.columns import check_weight_layout, pad_columns, padded_hidden_size
from k3_tail.config import TailConfig
from k3_tail.forward import check_mesh, tail_forward
from k3_tail.selection import Tier, TierDecision, select_tier


_LECUN_NORMAL = nnx.initializers.lecun_normal()


class LatentMoETail(nnx.Module):
    """The latent MoE tail of one layer, with its norm scale and up projection as ``nnx.Param``.

    Parameters (dtype ``config.dtype``, sharding metadata set with ``nnx.with_partitioning``):
      norm_scale: [L], replicated, initialised to ones; None when ``config.use_latent_norm`` is False.
      up_proj_kernel: Flax layout [L, Hs] (y = x @ W), lecun-normal initialised.
        weight_layout="column": Hs = padded_hidden_size(H, p), sharded ``(None, axis_name)``: each rank
          holds [L, Hs/p], 1/p of the memory; the padding columns (only when H % p != 0) are zero.
        weight_layout="replicated": Hs = H, whole on every rank, as vLLM stores it.

    Per-rank cost of each tier with each layout (T tokens, p ranks, bf16):
      native / overlap: replicated 2TLH FLOPs, 2LH weight bytes, AR(TL) + AR(TH);
                        column 2TLH/p FLOPs, 2LH/p weight bytes, AR(TL) + AR(TH) + AG of [T, H/p].
      column_parallel:  either layout 2TLH/p FLOPs, 2LH/p weight bytes, AR(TL) then AR(TH).
      scatter_gather:   either layout 2TLH/p FLOPs, 2LH/p weight bytes, AR(TL), RS(TH), AG(TH).
    The replicated layout keeps the whole kernel resident even on the column tiers.

    ``__call__(routed_partials, shared_partials, *, tier=None)`` takes and returns what
    :func:`k3_tail.tail_forward` does; ``plan(num_tokens)`` tells which tier a call would take and why.
    """

    def __init__(
        self,
        config: TailConfig,
        mesh: Mesh,
        *,
        rngs: nnx.Rngs,
        axis_name: str = "tp",
        weight_layout: str = "column",
        kernel_init: nnx.Initializer = _LECUN_NORMAL,
    ):
        if not isinstance(config, TailConfig):
            raise ValueError(f"config: expected a k3_tail.TailConfig, got {type(config).__name__}")
        tp_size = check_mesh(mesh, axis_name)
        self.config = config
        self.mesh = mesh
        self.axis_name = axis_name
        self.weight_layout = check_weight_layout(weight_layout)
        latent, hidden = config.latent_size, config.hidden_size

        if weight_layout == "column":
            width, kernel_sharding = padded_hidden_size(hidden, tp_size), (None, axis_name)
        else:
            width, kernel_sharding = hidden, (None, None)

        def init_kernel(key, shape, dtype):
            # Initialise the real [L, H] columns only, so padding never changes their distribution.
            return pad_columns(kernel_init(key, (latent, hidden), dtype), shape[1])

        self.up_proj_kernel = nnx.Param(
            nnx.with_partitioning(init_kernel, kernel_sharding, mesh=mesh)(rngs.params(), (latent, width), config.dtype)
        )
        self.norm_scale = (
            nnx.Param(nnx.with_partitioning(nnx.initializers.ones, (None,), mesh=mesh)(None, (latent,), config.dtype))
            if config.use_latent_norm
            else None
        )

    @property
    def tp_size(self) -> int:
        return self.mesh.shape[self.axis_name]

    def plan(self, num_tokens: int) -> TierDecision:
        """The tier a call with ``num_tokens`` tokens takes on this module's mesh, and why."""
        return select_tier(
            self.config, num_tokens, self.tp_size, weight_layout=self.weight_layout,
            device_kind=self.mesh.devices.flat[0].device_kind,
        )

    def __call__(self, routed_partials, shared_partials, *, tier: Tier | str | None = None) -> jax.Array:
        """y [T, H] from routed_partials [p, T, L] and shared_partials [p, T, H] (see tail_forward)."""
        return tail_forward(
            routed_partials,
            shared_partials,
            None if self.norm_scale is None else self.norm_scale[...],
            self.up_proj_kernel[...],
            config=self.config,
            mesh=self.mesh,
            axis_name=self.axis_name,
            tier=tier,
            weight_layout=self.weight_layout,
        )
