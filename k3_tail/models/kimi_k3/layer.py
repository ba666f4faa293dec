"""A Kimi-K3 latent MoE layer in tensor parallelism, ending in k3_tail's tail: where the tail's partials come from.

For hidden states x [T, H], replicated over the p TP ranks as vLLM serves the layer:

    scores  = sigmoid(x @ W_router)                           [T, E]  float32
    chosen  = top_k(scores + correction_bias)                 [T, k]  the bias only chooses
    weights = scores[chosen] / sum_k scores[chosen]           [T, k]  un-biased, renormalised to sum 1 when k > 1
    z       = x @ W_down                                      [T, L]  routed down projection H -> L
    r       = sum_k weights_k * SiTU(z @ G_e, z @ U_e) @ D_e  [T, L]  routed experts, e = chosen_k
    s       = SiTU(x @ G_s, x @ U_s) @ D_s                    [T, H]  shared experts
    y       = RMSNorm_g(c * r) @ W_up + s                     [T, H]  the tail
    SiTU(g, u) = 4 tanh(g / 4) sigmoid(g) * 25 tanh(u / 25)           (per element)

c is the tail config's ``routed_scaling_factor``: the tail applies it, so the router does not.

Per rank (:func:`~k3_tail.models.kimi_k3.parameters.partition_specs`): W_router [H, E], the correction bias [E]
(float32), W_down [H, L] and g [L] replicated; each routed expert's width m split (G, U [E, L, m/p], D [E, m/p, L]:
the routed partial r_i); the shared experts column-parallel in (G_s, U_s [H, F/p]) and row-parallel out
(D_s [F/p, H]: the shared partial s_i); then :func:`k3_tail.latent_moe_tail` on (r_i, s_i), W_up whole on every
rank ("replicated") or in column blocks ("column"), whose collectives are the layer's only ones. Kimi-K3's two
shared experts are one MLP of width F = 6144, concatenated (the same function: SiTU acts on each channel alone).

Numerics: weights and activations in ``config.tail.dtype`` (Kimi-K3: bf16), every GEMM accumulating in float32,
the router, SiTU and the weighted sum in float32; activations are rounded to the dtype where they enter a GEMM
and where the partials enter the tail.

Per-rank cost, d bytes per element: the input GEMM 2TH(E + L + 2F/p) FLOPs over dH(E + L + 2F/p) weight bytes;
routed experts 6TkLm/p over 3dLm/p per expert read (gather: T*k of them; capacity: all E, once; MXFP4:
d = 0.53125); the shared experts' down projection 2THF/p over dHF/p; then the tail tier's.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import k3_tail
from k3_tail.models.kimi_k3.layer_config import LayerConfig
from k3_tail.models.kimi_k3.packed_parameters import (
    RANK,
    abstract_parameters,
    held_partition_specs,
    pack_parameters,
    unpack_parameters,
)
from k3_tail.models.kimi_k3.parameters import layer_parameters, partition_specs, random_checkpoint
from k3_tail.models.kimi_k3.per_rank import layer_per_rank, rank_partials
from k3_tail.xla.compilation import compiler_options

# XLA options of every GPU compile of the layer, beside the tail tier's own. The latency-hiding scheduler keeps
# the early shared reduction in flight over the routed experts; jax 0.10.2's ROCm pipeline runs it only when asked
# (without it a prefill's reduction starts after all routed work on MI300X and MI355X).
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}


@functools.partial(jax.jit, static_argnames=("config", "mesh", "axis_name", "weight_layout", "tier"))
def layer_forward(parameters: Mapping[str, jax.Array], hidden_states: jax.Array, *, config: LayerConfig,
                  mesh: Mesh, axis_name: str = "tp", weight_layout: str = "replicated",
                  tier: k3_tail.Tier | str | None = None) -> jax.Array:
    """y [T, H] of the layer for hidden_states [T, H] of the layer's dtype, as one ``jax.shard_map`` over ``mesh``.

    ``parameters``: global arrays by the names of :func:`held_partition_specs` (placed as it says). ``tier``: a
    tail tier, or None for ``k3_tail.select_tier``'s. y is replicated, or with token-sharded output
    (``k3_tail.is_token_sharded_output``) [T', H] with T' = ``k3_tail.padded_token_count(T, p)``, split over
    ``axis_name``, the padding rows zero. ValueError for other hidden states or parameter names. Compiled once per
    T, placement and static argument; ``.lower(...)`` takes :func:`abstract_parameters`.
    """
    tp_size = mesh.shape[axis_name]
    num_tokens = _check_hidden_states(config, hidden_states)
    token_sharded = k3_tail.is_token_sharded_output(config.tail, num_tokens, tp_size)
    per_rank = functools.partial(layer_per_rank, config=config, axis_name=axis_name, weight_layout=weight_layout,
                                 tier=tier, device=mesh.devices.flat[0])
    return _shard_map(per_rank, parameters, hidden_states, config=config, mesh=mesh, axis_name=axis_name,
                      weight_layout=weight_layout, out_specs=P(axis_name) if token_sharded else P())


def layer_compiler_options(config: LayerConfig, mesh: Mesh, num_tokens: int, *, axis_name: str = "tp",
                           weight_layout: str = "replicated", tier: k3_tail.Tier | str | None = None) -> dict[str, Any]:
    """The per-executable XLA options of a :func:`layer_forward` compile for T tokens on ``mesh``: the tail tier's
    (``tier``, or the one the tail selects) and, on a GPU, :data:`GPU_COMPILER_OPTIONS`."""
    device = mesh.devices.flat[0]
    if tier is None:
        # The device, as the tail's own selection takes it: its platform decides ("rocm" or "cuda").
        tier = k3_tail.select_tier(config.tail, num_tokens, mesh.shape[axis_name], weight_layout=weight_layout,
                                   device_kind=device.device_kind, platform=device).tier
    options = dict(compiler_options(tier, device))
    if device.platform == "gpu":
        options.update(GPU_COMPILER_OPTIONS)
    return options


def compile_layer(config: LayerConfig, mesh: Mesh, num_tokens: int, *, axis_name: str = "tp",
                  weight_layout: str = "replicated", tier: k3_tail.Tier | str | None = None,
                  xla_options: Mapping[str, Any] | None = None) -> jax.stages.Compiled:
    """:func:`layer_forward` for T tokens compiled from :func:`abstract_parameters` (so also for a deviceless
    topology) with :func:`layer_compiler_options`, and over them ``xla_options``."""
    hidden = jax.ShapeDtypeStruct((num_tokens, config.hidden_size), config.dtype, sharding=NamedSharding(mesh, P()))
    parameters = abstract_parameters(config, mesh, axis_name=axis_name, weight_layout=weight_layout)
    lowered = layer_forward.lower(parameters, hidden, config=config, mesh=mesh, axis_name=axis_name,
                                  weight_layout=weight_layout, tier=tier)
    options = layer_compiler_options(config, mesh, num_tokens, axis_name=axis_name, weight_layout=weight_layout,
                                     tier=tier)
    return lowered.compile(compiler_options=options | dict(xla_options or {}))


@functools.partial(jax.jit, static_argnames=("config", "mesh", "axis_name", "weight_layout"))
def layer_partials(parameters: Mapping[str, jax.Array], hidden_states: jax.Array, *, config: LayerConfig,
                   mesh: Mesh, axis_name: str = "tp", weight_layout: str = "replicated") -> tuple[jax.Array, jax.Array]:
    """(routed [p, T, L], shared [p, T, H]): every rank's partials stacked, split over ``axis_name``, as
    ``k3_tail.tail_forward`` takes them."""
    _check_hidden_states(config, hidden_states)

    def per_rank(rank_parameters, rank_hidden_states):
        routed, shared = rank_partials(rank_parameters, rank_hidden_states, config=config)
        return routed[None], shared[None]

    return _shard_map(per_rank, parameters, hidden_states, config=config, mesh=mesh, axis_name=axis_name,
                      weight_layout=weight_layout, out_specs=(P(axis_name), P(axis_name)))


def _shard_map(per_rank, parameters, hidden_states, *, config, mesh, axis_name, weight_layout, out_specs):
    """``per_rank(parameter blocks, hidden_states)`` in a shard_map over ``mesh``, the inputs placed first."""
    specs = held_partition_specs(config, mesh.shape[axis_name], axis_name=axis_name, weight_layout=weight_layout)
    if set(parameters) != set(specs):
        raise ValueError(f"parameters: expected the names {sorted(specs)}, got {sorted(parameters)}")
    placed = {name: jax.device_put(parameters[name], NamedSharding(mesh, spec)) for name, spec in specs.items()}
    hidden_states = jax.device_put(hidden_states, NamedSharding(mesh, P()))
    return jax.shard_map(per_rank, mesh=mesh, in_specs=(specs, P()), out_specs=out_specs)(placed, hidden_states)


def _check_hidden_states(config: LayerConfig, hidden_states) -> int:
    """T, or ValueError unless hidden_states is a [T, H] array of the config's dtype."""
    shape, dtype = tuple(np.shape(hidden_states)), np.dtype(getattr(hidden_states, "dtype", None))
    if len(shape) != 2 or shape[1] != config.hidden_size or dtype != config.dtype:
        raise ValueError(f"hidden_states: expected a [T, {config.hidden_size}] array of {config.dtype.name}, "
                         f"got shape {shape} of {dtype.name}")
    return shape[0]


class KimiK3MoELayer(nnx.Module):
    """The layer (module docstring) with its parameters as ``nnx.Param``, sharded over ``mesh``.

    ``checkpoint``: every parameter of :func:`layer_parameters` by name, numpy or jax arrays of its global shape
    (cast to its dtype; MXFP4 codes and scales must be uint8), each placed as :func:`partition_specs` says (a jax
    array already placed so stays where it is), then packed (:func:`pack_parameters`). ValueError for another
    name, shape or a non-uint8 MXFP4 array. ``__call__(hidden_states, *, tier=None)`` is :func:`layer_forward`;
    ``partials`` is :func:`layer_partials`; ``plan(T)`` the tail tier a call with T tokens takes, and why.
    """

    def __init__(self, config: LayerConfig, mesh: Mesh, checkpoint: Mapping[str, Any], *, axis_name: str = "tp",
                 weight_layout: str = "replicated"):
        self.config = config
        self.mesh = mesh
        self.axis_name = axis_name
        self.weight_layout = weight_layout
        parameters = layer_parameters(config)
        specs = partition_specs(config, self.tp_size, axis_name=axis_name, weight_layout=weight_layout)
        if set(checkpoint) != set(parameters):
            raise ValueError(f"checkpoint: expected the names {sorted(parameters)}, got {sorted(checkpoint)}")
        placed = {}
        for name, parameter in parameters.items():
            value = checkpoint[name]
            if not isinstance(value, jax.Array):  # a jax.Array (loaded sharded) stays on its devices
                value = np.asarray(value)
            if value.shape != parameter.shape:
                raise ValueError(f"checkpoint: expected {name} of shape {parameter.shape}, got {value.shape}")
            if parameter.dtype == np.uint8 and value.dtype != parameter.dtype:
                raise ValueError(f"checkpoint: expected {name} of uint8 (MXFP4 codes or scales), got {value.dtype}")
            if value.dtype != parameter.dtype:
                value = value.astype(parameter.dtype)
            placed[name] = jax.device_put(value, NamedSharding(mesh, specs[name]))
        held = pack_parameters(placed, config, mesh, axis_name=axis_name, weight_layout=weight_layout)
        held_specs = held_partition_specs(config, self.tp_size, axis_name=axis_name, weight_layout=weight_layout)
        self.rank = RankIndices(held.pop(RANK))
        for name, value in held.items():
            setattr(self, name, nnx.Param(value, out_sharding=held_specs[name], mesh=mesh))

    @property
    def tp_size(self) -> int:
        return self.mesh.shape[self.axis_name]

    def parameter_values(self) -> dict[str, jax.Array]:
        """Every array :func:`layer_forward` takes (global arrays), by name."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param)) | {RANK: self.rank.get_value()}

    def checkpoint_values(self) -> dict[str, jax.Array]:
        """The checkpoint's arrays (:func:`layer_parameters`' names and global shapes, none of them p's)."""
        return unpack_parameters(self.parameter_values(), self.config, self.tp_size)

    def __call__(self, hidden_states: jax.Array, *, tier: k3_tail.Tier | str | None = None) -> jax.Array:
        return layer_forward(self.parameter_values(), hidden_states, config=self.config, mesh=self.mesh,
                             axis_name=self.axis_name, weight_layout=self.weight_layout, tier=tier)

    def partials(self, hidden_states: jax.Array) -> tuple[jax.Array, jax.Array]:
        return layer_partials(self.parameter_values(), hidden_states, config=self.config, mesh=self.mesh,
                              axis_name=self.axis_name, weight_layout=self.weight_layout)

    def plan(self, num_tokens: int) -> k3_tail.TierDecision:
        device = self.mesh.devices.flat[0]
        return k3_tail.select_tier(self.config.tail, num_tokens, self.tp_size, weight_layout=self.weight_layout,
                                   device_kind=device.device_kind, platform=device)


class RankIndices(nnx.Variable):
    """Each rank's index along the layer's TP axis, int32 [p] sharded over it: an input, not a parameter."""


def build_layer(config: LayerConfig, mesh: Mesh, *, seed: int = 0, axis_name: str = "tp",
                weight_layout: str = "replicated") -> KimiK3MoELayer:
    """A :class:`KimiK3MoELayer` on ``mesh`` holding :func:`random_checkpoint` (``seed``)."""
    return KimiK3MoELayer(config, mesh, random_checkpoint(config, seed=seed), axis_name=axis_name,
                          weight_layout=weight_layout)


def token_bucket(num_tokens: int) -> int:
    """The smallest power of two >= T (1 for T = 0): the token count a bucketed call compiles for."""
    return 1 << max(num_tokens - 1, 0).bit_length()


def pad_to_bucket(hidden_states: np.ndarray) -> np.ndarray:
    """hidden_states [T, H] on the host, padded with zero rows (each gives a zero row of y) to token_bucket(T)
    rows, so one program serves every T of a bucket. On the host: any device op on [T, H] compiles once per T."""
    num_tokens = hidden_states.shape[0]
    return np.pad(hidden_states, ((0, token_bucket(num_tokens) - num_tokens), (0, 0)))
