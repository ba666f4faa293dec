"""The Flax NNX module: a thin shell that owns the tail's weights and calls the tail on them.

Its weights are initialised at random, loaded from a checkpoint's [L, H] kernel (``load_up_proj``) or
read from a Hugging Face checkpoint (``LatentMoETail.from_checkpoint``).

``__call__`` takes global arrays (:func:`k3_tail.tail_forward`); ``per_rank`` runs inside a
caller's shard_map (:func:`k3_tail.latent_moe_tail`), for models that shard the layer themselves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from k3_tail._checks import AxisName, check_axis_name, check_mesh, expect_array
from k3_tail.checkpoint import load_tail_weights
from k3_tail.config import TailConfig, check_config
from k3_tail.forward import tail_forward
from k3_tail.per_rank import latent_moe_tail
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.rules import select_tier
from k3_tail.shared_reduction import reduce_shared
from k3_tail.ops.columns import check_weight_layout, pad_columns, padded_hidden_size
from k3_tail.tiers.registry import Tier
from k3_tail.ops.up_projection import QuantizedKernel, check_fp8_activations, quantize_up_proj

_LECUN_NORMAL = nnx.initializers.lecun_normal()


class LatentMoETail(nnx.Module):
    """The latent MoE tail of one layer, with its norm scale and up projection as ``nnx.Param``.

    Parameters (dtype ``config.dtype``, sharding metadata set with ``nnx.with_partitioning``):
      norm_scale: [L], replicated, initialised to ones; None when ``config.use_latent_norm`` is False.
      up_proj_kernel: Flax layout [L, Hs] (y = x @ W), lecun-normal initialised.
        weight_layout="column": Hs = padded_hidden_size(H, p), sharded ``(None, axis_name)``: each rank
          holds [L, Hs/p], 1/p of the memory; the padding columns (only when H % p != 0) are zero.
        weight_layout="replicated": Hs = H, whole on every rank, as vLLM stores it.
        With an FP8 ``config.up_proj_dtype``: the kernel's FP8 values (half the bytes of bf16),
        quantised from the initial kernel (and by :meth:`load_up_proj` from a checkpoint's).
      up_proj_scale: float32 [Hs], the per-column scales of the FP8 values, sharded like the kernel's
        columns; None without FP8.

    The tiers' per-rank costs with each layout are in the README's tier table; the replicated layout
    keeps the whole kernel resident even on the column tiers.

    ``__call__(routed_partials, shared_partials, *, tier=None)`` takes and returns what
    :func:`k3_tail.tail_forward` does; ``per_rank(routed_partial, shared_partial, *, tier=None)``
    what :func:`k3_tail.latent_moe_tail` does, inside a shard_map that hands it this rank's blocks of
    the parameters (``nnx.shard_map`` with in_spec
    ``nnx.StateSharding(nnx.get_partition_spec(nnx.state(module)))`` for the module);
    ``reduce_shared(shared_partial)`` is :func:`k3_tail.reduce_shared` on the module's axis, for
    ``config.shared_output_is_reduced``; ``plan(num_tokens)`` tells which tier a call would take and why.
    ``LatentMoETail.from_checkpoint(checkpoint, layer, config=..., mesh=...)`` builds the module with the
    weights of a Hugging Face checkpoint's layer (:func:`k3_tail.load_tail_weights`).
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
        # FP8 activations in a format the mesh's GPUs do not multiply are refused here, before any weight is made.
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
        """The tail of decoder layer ``layer`` of a Hugging Face checkpoint, its parameters loaded with
        :func:`k3_tail.load_tail_weights` (same arguments; each device reads only its block of the kernel,
        quantised at load with an FP8 ``config.up_proj_dtype``). Nothing is initialised at random: the
        module is built abstractly (``nnx.eval_shape``) and then given the loaded arrays."""
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

    def load_up_proj(self, kernel) -> None:
        """Set the up projection from a checkpoint's [L, H] kernel (numpy or jax, ``config.dtype``).

        With an FP8 ``config.up_proj_dtype`` the kernel is quantised here, at load
        (:func:`k3_tail.quantize_up_proj`: per-column scales). The parameters take the layout and
        sharding this module was built with (padding columns zero). The caller's array is not
        modified. A wrong shape or dtype, or a non-finite kernel, is a ValueError naming ``kernel``.
        """
        latent, hidden = self.config.latent_size, self.config.hidden_size
        expect_array(kernel, "kernel", [(latent, hidden)], self.config.dtype, f"L={latent}, H={hidden}")
        self._set_up_proj(jnp.asarray(kernel))

    def _set_up_proj(self, kernel: jax.Array) -> None:
        """The up-projection parameters from an [L, H] kernel: quantised when the config says so,
        padded to the layout's width, sharded by columns or replicated."""
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
        """The tier a call with ``num_tokens`` tokens takes on this module's mesh, and why."""
        device = self.mesh.devices.flat[0]
        return select_tier(self.config, num_tokens, self.tp_size, weight_layout=self.weight_layout,
                           device_kind=device.device_kind, platform=device.platform)

    def __call__(self, routed_partials, shared_partials, *, tier: Tier | str | None = None) -> jax.Array:
        """y [T, H] from routed_partials [p, T, L] and shared_partials [p, T, H] (see tail_forward)."""
        return tail_forward(routed_partials, shared_partials, *self._weights(), config=self.config, mesh=self.mesh,
                            axis_name=self.axis_name, tier=tier, weight_layout=self.weight_layout)

    def per_rank(self, routed_partial, shared_partial, *, tier: Tier | str | None = None) -> jax.Array:
        """This rank's result from its routed [T, L] and shared [T, H] partials, inside a shard_map
        over this module's mesh in which the parameters are this rank's blocks (see
        :func:`k3_tail.latent_moe_tail` for what it returns and the out_spec that fits)."""
        return latent_moe_tail(routed_partial, shared_partial, *self._weights(), config=self.config,
                               axis_name=self.axis_name, weight_layout=self.weight_layout, tier=tier,
                               device=self.mesh.devices.flat[0])

    def reduce_shared(self, shared_partial) -> jax.Array:
        """This rank's shared partial [T, H] reduced over the module's TP axis, in the form ``per_rank``
        takes it with ``config.shared_output_is_reduced`` (:func:`k3_tail.reduce_shared`), inside a
        shard_map over this module's mesh: call it as soon as the shared experts finish."""
        return reduce_shared(shared_partial, config=self.config, axis_name=self.axis_name,
                             device=self.mesh.devices.flat[0])

    def _weights(self) -> tuple[jax.Array | None, jax.Array | QuantizedKernel]:
        """(norm weight or None, up-projection kernel): the values of the parameters."""
        kernel = self.up_proj_kernel[...]
        if self.up_proj_scale is not None:
            kernel = QuantizedKernel(kernel, self.up_proj_scale[...])
        return None if self.norm_scale is None else self.norm_scale[...], kernel


def _sharded_param(value: jax.Array, sharding: tuple, mesh: Mesh) -> nnx.Param:
    """An ``nnx.Param`` holding ``value``, placed and annotated with ``sharding`` over ``mesh``."""
    return nnx.Param(nnx.with_partitioning(lambda: value, sharding, mesh=mesh)())
