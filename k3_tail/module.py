"""The Flax NNX module: a thin shell that owns the tail's weights and calls the tail on them.

Its weights are initialised at random, set from a checkpoint's [L, H] kernel (``load_up_proj``), read
from a Hugging Face checkpoint (``LatentMoETail.from_checkpoint``) or restored from a tail's saved state at
any TP size (``LatentMoETail.restore``).
"""

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
    """The latent MoE tail of one layer, with its norm scale and up projection as ``nnx.Param``.

    ``module(routed_partials, shared_partials)`` runs :func:`k3_tail.tail_forward` on global arrays;
    :meth:`per_rank` runs :func:`k3_tail.latent_moe_tail` inside a caller's shard_map, for models that
    shard the layer themselves. The parameters carry their sharding (``nnx.with_partitioning``).

    Args:
      config: the tail's :class:`TailConfig`.
      mesh: the Mesh the tail runs on, with the TP axis ``axis_name``.
      rngs: where the initial kernel's randomness comes from (``rngs.params()``).
      axis_name: the TP axis: a mesh axis name or a tuple of them.
      weight_layout: "column": each rank holds [L, Hs/p] of the kernel, 1/p of the memory.
        "replicated": the whole kernel on every rank, as vLLM stores it (also on the column tiers).
      kernel_init: the initialiser of the [L, H] kernel (lecun-normal); padding columns are zero.

    Attributes:
      norm_scale: [L] in ``config.dtype``, replicated, initialised to ones; None when
        ``config.use_latent_norm`` is False.
      up_proj_kernel: [L, Hs] (y = x @ W); Hs = padded_hidden_size(H, p) sharded ``(None, axis_name)``
        for "column", Hs = H for "replicated". With an FP8 ``config.up_proj_dtype``: the FP8 values,
        quantised from the initial kernel (or the loaded one).
      up_proj_scale: float32 [Hs], the per-column scales of the FP8 values, sharded like the kernel's
        columns; None without FP8.

    Raises:
      ValueError: naming the argument, for a bad config, mesh, axis, layout or ``rngs``, or FP8 activations
        in a format the mesh's GPUs do not multiply natively (checked before any weight is made).
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
        """The tail of decoder layer ``layer`` of a Hugging Face checkpoint, with its loaded weights.

        Nothing is initialised at random: the module is built abstractly (``nnx.eval_shape``) and then
        given the arrays of :func:`k3_tail.load_tail_weights`, where each device reads only its block.

        Args:
          checkpoint: a checkpoint path or an opened :class:`k3_tail.checkpoint.Checkpoint`.
          layer: the decoder layer, a MoE one.
          config: the tail's :class:`TailConfig` (e.g. ``TailConfig.from_hf_config(directory)``).
          mesh: the Mesh the tail runs on.
          axis_name: the TP axis.
          weight_layout: "column" or "replicated", as for the constructor.

        Returns:
          The module, its kernel quantised at load with an FP8 ``config.up_proj_dtype``.

        Raises:
          ValueError: as :func:`k3_tail.load_tail_weights` raises it.
        """
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
        """The tail whose ``nnx.state`` was saved, on ``mesh``: at any TP size p', whatever p saved it.

        Built abstractly (``nnx.eval_shape``, nothing initialised), then given the state of
        :func:`k3_tail.checkpoint.restore_tail_state`, its padding columns re-cut for p'.

        Args:
          checkpoint: the directory orbax's ``StandardCheckpointer`` saved ``nnx.state(tail)`` to, or that
            state in memory, as :func:`k3_tail.checkpoint.restore_tail_state` takes it.
          config: the tail's :class:`TailConfig` (H, L, dtypes and norm those of the saved tail).
          mesh: the Mesh the tail runs on.
          axis_name: the TP axis.
          weight_layout: "column" or "replicated", as for the constructor (either layout's state restores).

        Returns:
          The module, its parameters as its constructor places them on ``mesh``.

        Raises:
          ValueError: as the constructor raises it (checked before anything is read), and as
            :func:`k3_tail.checkpoint.restore_tail_state` raises it.
        """
        module = nnx.eval_shape(lambda: cls(config, mesh, rngs=nnx.Rngs(0), axis_name=axis_name,
                                            weight_layout=weight_layout))
        nnx.update(module, restore_tail_state(checkpoint, config=config, mesh=mesh, axis_name=axis_name,
                                              weight_layout=weight_layout))
        return module

    def load_up_proj(self, kernel) -> None:
        """Set the up projection from a checkpoint's [L, H] kernel; the caller's array is not modified.

        Args:
          kernel: numpy or jax [L, H] in ``config.dtype``; quantised here with an FP8
            ``config.up_proj_dtype`` (:func:`k3_tail.quantize_up_proj`), then padded and sharded in
            the layout the module was built with.

        Raises:
          ValueError: naming ``kernel``, for a wrong shape or dtype or a non-finite kernel.
        """
        latent, hidden = self.config.latent_size, self.config.hidden_size
        expect_array(kernel, "kernel", [(latent, hidden)], self.config.dtype, f"L={latent}, H={hidden}")
        self._set_up_proj(jnp.asarray(kernel))

    def _set_up_proj(self, kernel: jax.Array) -> None:
        """The up-projection parameters from an [L, H] kernel: quantised if the config says so, padded
        to the layout's width, sharded by columns or replicated."""
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
        """The tier a call with ``num_tokens`` tokens takes on this module's mesh, and why.

        Args:
          num_tokens: T of the call.

        Returns:
          The :class:`k3_tail.TierDecision` of :func:`k3_tail.select_tier` for this mesh's device.
        """
        device = self.mesh.devices.flat[0]
        return select_tier(self.config, num_tokens, self.tp_size, weight_layout=self.weight_layout,
                           device_kind=device.device_kind, platform=device)

    def __call__(self, routed_partials, shared_partials, *, tier: Tier | str | None = None) -> jax.Array:
        """y from routed_partials [p, T, L] and shared_partials [p, T, H].

        Args:
          routed_partials: as :func:`k3_tail.tail_forward` takes them.
          shared_partials: as :func:`k3_tail.tail_forward` takes them.
          tier: a tier to force, or None to select one.

        Returns:
          What :func:`k3_tail.tail_forward` returns, on the module's weights and mesh: y [T, H]
          replicated, or with ``config.sequence_parallel`` y padded to T' = ``padded_token_count(T, p)``
          rows, [T', H], sharded over the TP axis on its tokens (rows from T on zero), as
          :meth:`per_rank` returns each rank's [T'/p, H] of it.
        """
        return tail_forward(routed_partials, shared_partials, *self._weights(), config=self.config, mesh=self.mesh,
                            axis_name=self.axis_name, tier=tier, weight_layout=self.weight_layout)

    def per_rank(self, routed_partial, shared_partial, *, tier: Tier | str | None = None,
                 rank: jax.Array | None = None) -> jax.Array:
        """This rank's result, inside a shard_map over the module's mesh that hands it its parameter blocks.

        The in_spec of the module is ``nnx.StateSharding(nnx.get_partition_spec(nnx.state(module)))``
        under ``nnx.shard_map``.

        Args:
          routed_partial: this rank's [T, L], as :func:`k3_tail.latent_moe_tail` takes it.
          shared_partial: this rank's [T, H] (or the reduced shared output), as there.
          tier: a tier to force, or None to select one.
          rank: this rank's index, int32 [1], as :func:`k3_tail.latent_moe_tail` takes it (without it the
            one_kernel tier finds it with a second GPU kernel).

        Returns:
          What :func:`k3_tail.latent_moe_tail` returns: [T, H], or with ``config.sequence_parallel``
          this rank's [T'/p, H] rows of y padded to T' = ``padded_token_count(T, p)`` rows, for every
          T (out_spec ``P(axis_name)``; :func:`k3_tail.is_token_sharded_output`).
        """
        # No device: inside the caller's program the tier is the lowering platform's (an NNX model exported from a
        # CPU host for ROCm holds ROCm's); the FP8 check ran against the mesh's devices when the module was made.
        return latent_moe_tail(routed_partial, shared_partial, *self._weights(), config=self.config,
                               axis_name=self.axis_name, weight_layout=self.weight_layout, tier=tier, rank=rank)

    def reduce_shared(self, shared_partial) -> jax.Array:
        """:func:`k3_tail.reduce_shared` on the module's TP axis, inside a shard_map over its mesh.

        Call it as soon as the shared experts finish, with ``config.shared_output_is_reduced``.

        Args:
          shared_partial: this rank's shared-expert partial [T, H].

        Returns:
          The reduced shared output, in the form :meth:`per_rank` takes it.
        """
        return reduce_shared(shared_partial, config=self.config, axis_name=self.axis_name)

    def _weights(self) -> tuple[jax.Array | None, jax.Array | QuantizedKernel]:
        """(norm weight or None, up-projection kernel): the values of the parameters."""
        kernel = self.up_proj_kernel[...]
        if self.up_proj_scale is not None:
            kernel = QuantizedKernel(kernel, self.up_proj_scale[...])
        return None if self.norm_scale is None else self.norm_scale[...], kernel


def _sharded_param(value: jax.Array, sharding: tuple, mesh: Mesh) -> nnx.Param:
    """An ``nnx.Param`` holding ``value``, placed and annotated with ``sharding`` over ``mesh``."""
    return nnx.Param(nnx.with_partitioning(lambda: value, sharding, mesh=mesh)())
