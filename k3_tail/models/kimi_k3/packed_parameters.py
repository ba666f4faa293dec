"""What the Kimi-K3 layer holds per rank: the checkpoint's parameters with the kernels that multiply x packed into
one, and each rank's index. :func:`unpack_parameters` gives the checkpoint's arrays back, which hold no trace of p.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail.models.kimi_k3.layer_config import LayerConfig
from k3_tail.models.kimi_k3.parameters import Parameter, layer_parameters, partition_specs

# The four kernels that multiply the hidden states, packed at load into one per-rank kernel (INPUT_KERNEL) in
# this order, so that one GEMM reads x once for all of them: [H, E | L | F/p | F/p] per rank.
INPUT_WEIGHTS = ("router_kernel", "down_proj", "shared_gate", "shared_up")
INPUT_KERNEL = "input_kernel"
# Each rank's index along the TP axis, int32 [p] sharded over it: a program argument, so that no partition-id
# (and no kernel converting it) is left in the compiled layer for the tail's one-kernel tier.
RANK = "rank"


def held_parameters(config: LayerConfig, tp_size: int) -> dict[str, Parameter]:
    """Every array the layer takes, by name: the checkpoint's with :data:`INPUT_WEIGHTS` packed into
    ``input_kernel`` [H, p W], W = E + L + 2F/p (rank i's block: :func:`input_columns`), and ``rank`` int32 [p]."""
    checkpoint = layer_parameters(config)
    width = config.num_experts + config.latent_size + 2 * config.shared_intermediate_size // tp_size
    held = {name: parameter for name, parameter in checkpoint.items() if name not in INPUT_WEIGHTS}
    held[INPUT_KERNEL] = Parameter((config.hidden_size, tp_size * width), config.dtype, 0.0)
    held[RANK] = Parameter((tp_size,), np.dtype(np.int32), 0.0)
    return held


def held_partition_specs(config: LayerConfig, tp_size: int, *, axis_name: str = "tp",
                         weight_layout: str = "replicated") -> dict[str, P]:
    """The partition spec of every array the layer takes (:func:`held_parameters`), by name."""
    specs = partition_specs(config, tp_size, axis_name=axis_name, weight_layout=weight_layout)
    held = {name: spec for name, spec in specs.items() if name not in INPUT_WEIGHTS}
    return held | {INPUT_KERNEL: P(None, axis_name), RANK: P(axis_name)}


def pack_parameters(checkpoint: Mapping[str, jax.Array], config: LayerConfig, mesh: Mesh, *, axis_name: str = "tp",
                    weight_layout: str = "replicated") -> dict[str, jax.Array]:
    """The arrays the layer takes (:func:`held_parameters`) from the checkpoint's global arrays: each rank
    concatenates its blocks of :data:`INPUT_WEIGHTS` where they lie (no collective; a transient copy)."""
    specs = partition_specs(config, mesh.shape[axis_name], axis_name=axis_name, weight_layout=weight_layout)
    placed = {name: jax.device_put(checkpoint[name], NamedSharding(mesh, specs[name])) for name in INPUT_WEIGHTS}
    packed = _pack(placed, mesh=mesh, specs=tuple(specs[name] for name in INPUT_WEIGHTS), axis_name=axis_name)
    rank = jax.device_put(np.arange(mesh.shape[axis_name], dtype=np.int32), NamedSharding(mesh, P(axis_name)))
    rest = {name: value for name, value in checkpoint.items() if name not in INPUT_WEIGHTS}
    return rest | {INPUT_KERNEL: packed, RANK: rank}


@functools.partial(jax.jit, static_argnames=("mesh", "specs", "axis_name"))
def _pack(placed, *, mesh, specs, axis_name):
    def per_rank(*blocks):
        return jnp.concatenate(blocks, axis=1)

    return jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=P(None, axis_name), check_vma=False)(
        *(placed[name] for name in INPUT_WEIGHTS))


def unpack_parameters(held: Mapping[str, jax.Array], config: LayerConfig, tp_size: int) -> dict[str, jax.Array]:
    """The checkpoint's global arrays from what :func:`pack_parameters` made; the unpacked ones replicated."""
    kernel = held[INPUT_KERNEL]
    # Replicated first: the slices below then read no other rank's block (and an Explicit mesh types them).
    blocks = jax.device_put(kernel, NamedSharding(kernel.sharding.mesh, P())).reshape(config.hidden_size, tp_size, -1)
    router, down, gate, up = input_columns(blocks, config)
    unpacked = {"router_kernel": router[:, 0], "down_proj": down[:, 0],
                "shared_gate": gate.reshape(config.hidden_size, -1), "shared_up": up.reshape(config.hidden_size, -1)}
    return {name: value for name, value in held.items() if name not in (INPUT_KERNEL, RANK)} | unpacked


def abstract_parameters(config: LayerConfig, mesh: Mesh, *, axis_name: str = "tp",
                        weight_layout: str = "replicated") -> dict[str, jax.ShapeDtypeStruct]:
    """Every array the layer takes (:func:`held_parameters`) as a ``jax.ShapeDtypeStruct`` placed on ``mesh``: to
    compile :func:`~k3_tail.models.kimi_k3.layer.layer_forward` without values."""
    tp_size = mesh.shape[axis_name]
    specs = held_partition_specs(config, tp_size, axis_name=axis_name, weight_layout=weight_layout)
    return {name: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, specs[name]))
            for name, p in held_parameters(config, tp_size).items()}


def input_columns(array: jax.Array, config: LayerConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``array`` [..., W] laid out as a rank's block of the input kernel split along its last axis: (router
    [..., E], down projection [..., L], shared gate [..., F/p], shared up [..., F/p])."""
    experts, latent = config.num_experts, config.latent_size
    shared = (array.shape[-1] - experts - latent) // 2
    bounds = np.cumsum([0, experts, latent, shared, shared])
    return tuple(array[..., start:stop] for start, stop in zip(bounds[:-1], bounds[1:], strict=True))
