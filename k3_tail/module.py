"""The Flax NNX module: a thin shell that owns the tail's weights and calls the tail on them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from k3_tail._checks import AxisName, check_axis_name, check_mesh, expect_array
from k3_tail.checkpoint import load_tail_weights, restore_tail_state
from k3_tail.config import TailConfig, check_config
from k3_tail.forward import tail_forward
from k3_tail.ops.columns import check_weight_layout, pad_columns, padded_hidden_size
from k3_tail.ops.up_projection import QuantizedKernel, check_fp8_activations, quantize_up_proj
from k3_tail.per_rank import latent_moe_tail
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.rules import select_tier
from k3_tail.shared_reduction import reduce_shared
from k3_tail.tiers.registry import Tier

_LECUN_NORMAL = nnx.initializers.lecun_normal()


class LatentMoETail(nnx.Module):
    """The latent MoE tail of one layer, its norm scale and up projection ``nnx.Param`` carrying their sharding.

    ``module(routed_partials, shared_partials)`` runs :func:`k3_tail.tail_forward` on global arrays;
    :meth:`per_rank` runs :func:`k3_tail.latent_moe_tail` inside a caller's shard_map.

    Args:
      config, mesh, axis_name: the tail's :class:`TailConfig`; the Mesh with the TP axis (a name or a tuple).
      rngs: where the initial kernel's randomness comes from (``rngs.params()``).
      weight_layout: "column" (each rank holds [L, Hs/p]) or "replicated" (the whole kernel, as vLLM).
      kernel_init: the initialiser of the [L, H] kernel (lecun-normal); padding columns are zero.

    Attributes:
      norm_scale: [L] in ``config.dtype``, replicated, ones at first; None without ``config.use_latent_norm``.
      up_proj_kernel: [L, Hs] (y = x @ W), Hs = padded_hidden_size(H, p) sharded ``(None, axis_name)`` for
        "column", H for "replicated"; the FP8 values with an FP8 ``config.up_proj_dtype``.
      up_proj_scale: float32 [Hs], the FP8 values' per-column scales, sharded likewise; None without FP8.

    Raises:
      ValueError: naming the argument, for a bad config, mesh, axis, layout or ``rngs``, or FP8 activations
        in a format the mesh's GPUs do not multiply natively (before any weight is made).
    """

    def __init__(
        self,
        config: TailConfig,
        mesh: Mesh,
        *,
        rngs: nnx.Rngs,
        axis_name: AxisName = "tp",
        weight_layout: str = "column",
        kernel_init: nnx.Initializer = _LECUN_NORMAL,
    ):
        check_config(config)
        axis_name = check_axis_name(axis_name)
        check_mesh(mesh, axis_name)
        if not isinstance(rngs, nnx.Rngs):
            raise ValueError(f"rngs: expected a flax.nnx.Rngs (nnx.Rngs(0)), got {type(rngs).__name__}")
        check_fp8_activations(config.up_proj_dtype, config.fp8_activations, mesh.devices.flat[0])
        self.config = config
        self.mesh = mesh
        self.axis_name = axis_name
        self.weight_layout = check_weight_layout(weight_layout)
        latent, hidden = config.latent_size, config.hidden_size
        # Initialise the real [L, H] columns only, so padding never changes their distribution.
        self._set_up_proj(kernel_init(rngs.params(), (latent, hidden), config.dtype))
        self.norm_scale = (
            nnx.Param(nnx.with_partitioning(nnx.initializers.ones, (None,), mesh=mesh)(None, (latent,), config.dtype))
            if config.use_latent_norm
            else None
        )

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint,
        layer: int,
        *,
        config: TailConfig,
        mesh: Mesh,
        axis_name: AxisName = "tp",
        weight_layout: str = "column",
    ) -> LatentMoETail:
        """The tail of MoE decoder layer ``layer`` of a Hugging Face ``checkpoint`` (a path or an opened
        :class:`k3_tail.checkpoint.Checkpoint`), built abstractly and given :func:`k3_tail.load_tail_weights`'
        arrays (each device reads its block; an FP8 kernel is quantised at load). The other arguments are the
        constructor's. ValueError as :func:`k3_tail.load_tail_weights` raises it."""
        norm_weight, kernel = load_tail_weights(checkpoint, layer, config=config, mesh=mesh, axis_name=axis_name,
                                                weight_layout=weight_layout)
        module = nnx.eval_shape(lambda: cls(config, mesh, rngs=nnx.Rngs(0), axis_name=axis_name,
                                            weight_layout=weight_layout))
        columns = module.axis_name if weight_layout == "column" else None
        values, scale = (kernel.values, kernel.scale) if isinstance(kernel, QuantizedKernel) else (kernel, None)
        module.up_proj_kernel = _sharded_param(values, (None, columns), mesh)
        module.up_proj_scale = None if scale is None else _sharded_param(scale, (columns,), mesh)
        module.norm_scale = None if norm_weight is None else _sharded_param(norm_weight, (None,), mesh)
        return module

    @classmethod
    def restore(
        cls,
        checkpoint,
        *,
        config: TailConfig,
        mesh: Mesh,
        axis_name: AxisName = "tp",
        weight_layout: str = "column",
    ) -> LatentMoETail:
        """The tail whose ``nnx.state`` was saved (``checkpoint``: orbax's directory, or the state in memory), on
        ``mesh`` at any TP size, whatever p saved it, from either layout's state; built abstractly, its padding
        columns re-cut. The other arguments are the constructor's (``config``: the saved tail's sizes and
        dtypes). ValueError as the constructor (before anything is read) and
        :func:`k3_tail.checkpoint.restore_tail_state` raise it."""
        module = nnx.eval_shape(lambda: cls(config, mesh, rngs=nnx.Rngs(0), axis_name=axis_name,
                                            weight_layout=weight_layout))
        nnx.update(module, restore_tail_state(checkpoint, config=config, mesh=mesh, axis_name=axis_name,
                                              weight_layout=weight_layout))
        return module

    def load_up_proj(self, kernel) -> None:
        """Set the up projection from a checkpoint's ``kernel`` (numpy or jax [L, H] in ``config.dtype``, not
        modified): quantised with an FP8 ``config.up_proj_dtype``, padded and sharded in the module's layout.
        ValueError naming ``kernel`` for a wrong shape or dtype or a non-finite kernel."""
        latent, hidden = self.config.latent_size, self.config.hidden_size
        expect_array(kernel, "kernel", [(latent, hidden)], self.config.dtype, f"L={latent}, H={hidden}")
        self._set_up_proj(jnp.asarray(kernel))

    def _set_up_proj(self, kernel: jax.Array) -> None:
        """The up-projection parameters from an [L, H] kernel, quantised, padded and sharded as configured."""
        if self.config.up_proj_dtype is not None:
            kernel = quantize_up_proj(kernel, self.config.up_proj_dtype)
        columns = None
        if self.weight_layout == "column":
            columns = self.axis_name
            kernel = pad_columns(kernel, padded_hidden_size(self.config.hidden_size, self.tp_size))
        values, scale = (kernel.values, kernel.scale) if isinstance(kernel, QuantizedKernel) else (kernel, None)
        self.up_proj_kernel = _sharded_param(values, (None, columns), self.mesh)
        self.up_proj_scale = None if scale is None else _sharded_param(scale, (columns,), self.mesh)

    @property
    def tp_size(self) -> int:
        """p: the size of the TP axis (the product over a tuple of axes)."""
        return check_mesh(self.mesh, self.axis_name)

    def plan(self, num_tokens: int) -> TierDecision:
        """The :class:`k3_tail.TierDecision` a call of ``num_tokens`` tokens gets on this module's mesh."""
        device = self.mesh.devices.flat[0]
        return select_tier(self.config, num_tokens, self.tp_size, weight_layout=self.weight_layout,
                           device_kind=device.device_kind, platform=device)

    def __call__(self, routed_partials, shared_partials, *, tier: Tier | str | None = None) -> jax.Array:
        """:func:`k3_tail.tail_forward` of routed_partials [p, T, L] and shared_partials [p, T, H] on the module's
        weights and mesh (``tier``: one to force, or None): y [T, H] replicated, or with
        ``config.sequence_parallel`` [T', H] sharded over the TP axis on its tokens (rows from T on zero)."""
        return tail_forward(routed_partials, shared_partials, *self._weights(), config=self.config, mesh=self.mesh,
                            axis_name=self.axis_name, tier=tier, weight_layout=self.weight_layout)

    def per_rank(self, routed_partial, shared_partial, *, tier: Tier | str | None = None,
                 rank: jax.Array | None = None) -> jax.Array:
        """:func:`k3_tail.latent_moe_tail` of this rank's arguments, as it takes them, on the module's parameter
        blocks, inside ``nnx.shard_map`` over its mesh (the module's in_spec:
        ``nnx.StateSharding(nnx.get_partition_spec(nnx.state(module)))``)."""
        # No device: the tier is the lowering platform's (an NNX model exported from a CPU host for ROCm holds
        # ROCm's); the FP8 check ran against the mesh's devices when the module was made.
        return latent_moe_tail(routed_partial, shared_partial, *self._weights(), config=self.config,
                               axis_name=self.axis_name, weight_layout=self.weight_layout, tier=tier, rank=rank)

    def reduce_shared(self, shared_partial) -> jax.Array:
        """:func:`k3_tail.reduce_shared` of this rank's ``shared_partial`` [T, H] on the module's TP axis, inside a
        shard_map over its mesh: the reduced shared output as :meth:`per_rank` takes it."""
        return reduce_shared(shared_partial, config=self.config, axis_name=self.axis_name)

    def _weights(self) -> tuple[jax.Array | None, jax.Array | QuantizedKernel]:
        kernel = self.up_proj_kernel[...]
        if self.up_proj_scale is not None:
            kernel = QuantizedKernel(kernel, self.up_proj_scale[...])
        return None if self.norm_scale is None else self.norm_scale[...], kernel


def _sharded_param(value: jax.Array, sharding: tuple, mesh: Mesh) -> nnx.Param:
    """An ``nnx.Param`` holding ``value``, placed and annotated with ``sharding`` over ``mesh``."""
    return nnx.Param(nnx.with_partitioning(lambda: value, sharding, mesh=mesh)())
