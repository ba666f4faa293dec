"""A decoder stack of the Kimi-K3 MoE layer: N layers as one ``jax.lax.scan`` inside one ``jax.shard_map``.

For hidden states h [T, H], replicated over the p TP ranks, each layer l = 0 .. N-1 computes

    h = attention(h)                          a per-rank function the caller passes (default: the identity)
    h = h + moe_l(RMSNorm_{g_l}(h))           moe_l: the layer of k3_tail/models/kimi_k3/layer.py

RMSNorm_g(v) = v / sqrt(mean(v^2) + eps) * g is the MoE layer's pre-norm (``post_attention_layernorm``, g [H], eps
``StackConfig.norm_eps``), in float32 and rounded once to the layer's dtype, in which the residual stream stays.

Cost: the FLOPs of N layers in a program of one layer's size (one while loop of N trips); XLA copies each trip's
packed input kernel out of the stacked arrays before its GEMM.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import k3_tail
from k3_tail.checkpoint import Checkpoint, open_checkpoint
from k3_tail.models.kimi_k3.checkpoint import load_layer
from k3_tail.models.kimi_k3.layer import KimiK3MoELayer, layer_compiler_options
from k3_tail.models.kimi_k3.layer_config import LayerConfig
from k3_tail.models.kimi_k3.packed_parameters import abstract_parameters, held_partition_specs
from k3_tail.models.kimi_k3.parameters import NORM_SCALE_STDDEV, STACKED_IN_PLACE, partition_specs, random_checkpoint
from k3_tail.models.kimi_k3.per_rank import layer_per_rank
from k3_tail.models.kimi_k3.reference import reference_layer

# The pre-norm's tensor under a decoder layer's prefix ("model.layers.N.") of a Hugging Face checkpoint.
PRE_NORM_TENSOR = "post_attention_layernorm.weight"
PARAMETER_GROUPS = ("layers", "pre_norm")


@dataclasses.dataclass(frozen=True)
class StackConfig:
    """N = ``num_layers`` MoE layers of ``layer``'s config, each after a pre-norm of eps ``norm_eps``. ValueError
    for a bad field or a ``layer.tail.sequence_parallel`` config (the residual stream is replicated)."""

    layer: LayerConfig
    num_layers: int
    norm_eps: float = 1e-5

    def __post_init__(self):
        if not isinstance(self.layer, LayerConfig):
            raise ValueError(f"layer: expected a LayerConfig, got {type(self.layer).__name__}")
        if self.layer.tail.sequence_parallel:
            raise ValueError("layer: the stack's residual stream is replicated; expected tail.sequence_parallel=False")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers: expected an integer >= 1, got {self.num_layers!r}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) \
                or not math.isfinite(self.norm_eps) or self.norm_eps <= 0:
            raise ValueError(f"norm_eps: expected a finite number > 0, got {self.norm_eps!r}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def dtype(self) -> np.dtype:
        return self.layer.dtype


def stack_partition_specs(config: StackConfig, tp_size: int, *, axis_name: str = "tp",
                          weight_layout: str = "replicated") -> dict[str, Any]:
    """{"pre_norm": P(), "layers": {name: P(None, *spec)}}: one layer's held specs behind the layer axis."""
    specs = held_partition_specs(config.layer, tp_size, axis_name=axis_name, weight_layout=weight_layout)
    return {"pre_norm": P(), "layers": {name: P(None, *spec) for name, spec in specs.items()}}


def abstract_stack_parameters(config: StackConfig, mesh: Mesh, *, axis_name: str = "tp",
                              weight_layout: str = "replicated") -> dict[str, Any]:
    """The stack's parameters as ``jax.ShapeDtypeStruct``s placed on ``mesh``: to compile without values."""
    specs = stack_partition_specs(config, mesh.shape[axis_name], axis_name=axis_name, weight_layout=weight_layout)
    layer = abstract_parameters(config.layer, mesh, axis_name=axis_name, weight_layout=weight_layout)
    n = config.num_layers
    return {"pre_norm": jax.ShapeDtypeStruct((n, config.hidden_size), config.dtype,
                                             sharding=NamedSharding(mesh, specs["pre_norm"])),
            "layers": {name: jax.ShapeDtypeStruct((n, *value.shape), value.dtype,
                                                  sharding=NamedSharding(mesh, specs["layers"][name]))
                       for name, value in layer.items()}}


def rms_norm(hidden_states: jax.Array, scale: jax.Array, *, eps: float) -> jax.Array:
    """v / sqrt(mean(v^2) + eps) * g over the last axis, in float32, rounded once to hidden_states' dtype."""
    v = hidden_states.astype(jnp.float32)
    normed = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps) * scale.astype(jnp.float32)
    return normed.astype(hidden_states.dtype)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "attention", "axis_name", "weight_layout", "tier"))
def stack_forward(parameters: Mapping[str, Any], hidden_states: jax.Array, *, config: StackConfig, mesh: Mesh,
                  attention: Callable[[jax.Array], jax.Array] | None = None, axis_name: str = "tp",
                  weight_layout: str = "replicated", tier: k3_tail.Tier | str | None = None) -> jax.Array:
    """h [T, H] after the N layers (module docstring), replicated, in the layer's dtype.

    ``parameters``: {"pre_norm": [N, H], "layers": {name: [N, ...]}} as :func:`abstract_stack_parameters`
    describes them. ``attention``: a per-rank function of h [T, H] -> [T, H] of the same dtype, called before each
    layer, returning the same h on every rank. ``tier``: the tail's tier in every layer, or None for the tail's
    selection. ValueError naming the argument before any work. Compiled once per T, placement and static argument.
    """
    _check_hidden_states(config, hidden_states)
    if attention is not None and not callable(attention):
        raise ValueError(f"attention: expected a function of h [T, H] or None, got {attention!r}")
    specs = stack_partition_specs(config, mesh.shape[axis_name], axis_name=axis_name, weight_layout=weight_layout)
    _check_parameters(config, parameters, abstract_stack_parameters(config, mesh, axis_name=axis_name,
                                                                    weight_layout=weight_layout))
    one_layer = functools.partial(layer_per_rank, config=config.layer, axis_name=axis_name,
                                  weight_layout=weight_layout, tier=tier, device=mesh.devices.flat[0])

    def per_rank(rank_parameters, rank_hidden_states):
        # Whole to every trip, with the layer's index: a scanned slice would copy a layer's experts (GBs) every trip.
        layers = rank_parameters["layers"]
        in_place = {name: layers[name] for name in STACKED_IN_PLACE if name in layers}

        def layer_step(h, layer):
            if attention is not None:
                attended = attention(h)
                if attended.shape != h.shape or attended.dtype != h.dtype:
                    raise ValueError(f"attention: expected it to return h's shape {h.shape} and dtype "
                                     f"{h.dtype.name}, got {attended.shape} of {attended.dtype.name}")
                h = attended
            y = one_layer({**layer["layers"], **in_place}, rms_norm(h, layer["pre_norm"], eps=config.norm_eps),
                          layer_index=layer["index"])
            return (h + y).astype(h.dtype), None

        scanned = {"pre_norm": rank_parameters["pre_norm"], "index": jnp.arange(config.num_layers),
                   "layers": {name: value for name, value in layers.items() if name not in in_place}}
        return jax.lax.scan(layer_step, rank_hidden_states, scanned)[0]

    placed = {"pre_norm": jax.device_put(parameters["pre_norm"], NamedSharding(mesh, specs["pre_norm"])),
              "layers": {name: jax.device_put(parameters["layers"][name], NamedSharding(mesh, spec))
                         for name, spec in specs["layers"].items()}}
    hidden_states = jax.device_put(hidden_states, NamedSharding(mesh, P()))
    return jax.shard_map(per_rank, mesh=mesh, in_specs=(specs, P()), out_specs=P())(placed, hidden_states)


def compile_stack(config: StackConfig, mesh: Mesh, num_tokens: int, *,
                  attention: Callable[[jax.Array], jax.Array] | None = None, axis_name: str = "tp",
                  weight_layout: str = "replicated", tier: k3_tail.Tier | str | None = None,
                  xla_options: Mapping[str, Any] | None = None) -> jax.stages.Compiled:
    """:func:`stack_forward` for T tokens compiled from :func:`abstract_stack_parameters` (so also for a deviceless
    topology) with one layer's ``layer_compiler_options`` and, over them, ``xla_options``."""
    hidden = jax.ShapeDtypeStruct((num_tokens, config.hidden_size), config.dtype, sharding=NamedSharding(mesh, P()))
    parameters = abstract_stack_parameters(config, mesh, axis_name=axis_name, weight_layout=weight_layout)
    lowered = stack_forward.lower(parameters, hidden, config=config, mesh=mesh, attention=attention,
                                  axis_name=axis_name, weight_layout=weight_layout, tier=tier)
    options = layer_compiler_options(config.layer, mesh, num_tokens, axis_name=axis_name,
                                     weight_layout=weight_layout, tier=tier)
    return lowered.compile(compiler_options=options | dict(xla_options or {}))


def _check_hidden_states(config: StackConfig, hidden_states: Any) -> None:
    shape, dtype = tuple(np.shape(hidden_states)), np.dtype(getattr(hidden_states, "dtype", None))
    if len(shape) != 2 or shape[1] != config.hidden_size or dtype != config.dtype:
        raise ValueError(f"hidden_states: expected a [T, {config.hidden_size}] array of {config.dtype.name}, "
                         f"got shape {shape} of {dtype.name}")


def _check_parameters(config: StackConfig, parameters: Any, expected: Mapping[str, Any]) -> None:
    """ValueError naming the entry unless ``parameters`` has ``expected``'s names, shapes and dtypes."""
    if not isinstance(parameters, Mapping) or set(parameters) != set(PARAMETER_GROUPS):
        names = sorted(parameters) if isinstance(parameters, Mapping) else type(parameters).__name__
        raise ValueError(f"parameters: expected the names {list(PARAMETER_GROUPS)}, got {names}")
    layers = parameters["layers"]
    if not isinstance(layers, Mapping) or set(layers) != set(expected["layers"]):
        names = sorted(layers) if isinstance(layers, Mapping) else type(layers).__name__
        raise ValueError(f"parameters: expected layers with the names {sorted(expected['layers'])}, got {names}")
    given = {"pre_norm": parameters["pre_norm"], **{f"layers.{name}": layers[name] for name in expected["layers"]}}
    wanted = {"pre_norm": expected["pre_norm"], **{f"layers.{name}": value
                                                   for name, value in expected["layers"].items()}}
    for name, value in given.items():
        shape, dtype = tuple(np.shape(value)), np.dtype(getattr(value, "dtype", None))
        if shape != wanted[name].shape or dtype != wanted[name].dtype:
            raise ValueError(f"parameters: expected {name} of shape {wanted[name].shape} and {wanted[name].dtype.name} "
                             f"([num_layers = {config.num_layers}, ...one layer's]), got {shape} of {dtype.name}")


class DecoderStack(nnx.Module):
    """The stack (module docstring) with its parameters as ``nnx.Param``, sharded over ``mesh``.

    ``layers``: N per-layer checkpoints (as ``random_checkpoint`` returns) or N ``KimiK3MoELayer``s built alike,
    stacked once (holding the layers twice while building). ``pre_norm``: [N, H]. ValueError for another count,
    shape or layer set-up. ``__call__(hidden_states, *, attention=None, tier=None)`` is :func:`stack_forward`.
    """

    def __init__(self, config: StackConfig, mesh: Mesh, layers: Sequence[Mapping[str, Any] | KimiK3MoELayer],
                 pre_norm: Any, *, axis_name: str = "tp", weight_layout: str = "replicated"):
        if not isinstance(config, StackConfig):
            raise ValueError(f"config: expected a StackConfig, got {type(config).__name__}")
        self.config, self.mesh, self.axis_name, self.weight_layout = config, mesh, axis_name, weight_layout
        if len(layers) != config.num_layers:
            raise ValueError(f"layers: expected {config.num_layers} layers (config.num_layers), got {len(layers)}")
        pre_norm = pre_norm if isinstance(pre_norm, jax.Array) else np.asarray(pre_norm)
        if pre_norm.shape != (config.num_layers, config.hidden_size):
            raise ValueError(f"pre_norm: expected shape {(config.num_layers, config.hidden_size)} [N, H], "
                             f"got {pre_norm.shape}")
        built = [layer if isinstance(layer, KimiK3MoELayer) else
                 KimiK3MoELayer(config.layer, mesh, layer, axis_name=axis_name, weight_layout=weight_layout)
                 for layer in layers]
        for index, layer in enumerate(built):
            if (layer.config, layer.mesh, layer.axis_name, layer.weight_layout) != (
                    config.layer, mesh, axis_name, weight_layout):
                raise ValueError(f"layers: layer {index} is built for another config, mesh, axis_name or "
                                 "weight_layout than the stack's")
        specs = stack_partition_specs(config, mesh.shape[axis_name], axis_name=axis_name, weight_layout=weight_layout)
        shardings = {name: NamedSharding(mesh, spec) for name, spec in specs["layers"].items()}
        stacked = jax.jit(lambda values: {name: jnp.stack([value[name] for value in values]) for name in shardings},
                          out_shardings=shardings)([layer.parameter_values() for layer in built])
        placed = jax.device_put(pre_norm.astype(config.dtype), NamedSharding(mesh, specs["pre_norm"]))
        self.pre_norm = nnx.Param(placed, out_sharding=specs["pre_norm"], mesh=mesh)
        # Each stacked array keeps the kind of Variable the layer holds it as: a Param, or another (the ranks' indices).
        kinds = {path[-1]: type(variable) for path, variable in nnx.to_flat_state(nnx.state(built[0]))}
        self.layers = nnx.Dict({name: nnx.Param(value, out_sharding=specs["layers"][name], mesh=mesh)
                                if issubclass(kinds[name], nnx.Param) else kinds[name](value)
                                for name, value in stacked.items()})

    def parameter_values(self) -> dict[str, Any]:
        """{"pre_norm": [N, H], "layers": {name: [N, ...]}}: the global arrays :func:`stack_forward` takes."""
        return nnx.to_pure_dict(nnx.state(self))

    def __call__(self, hidden_states: jax.Array, *, attention: Callable[[jax.Array], jax.Array] | None = None,
                 tier: k3_tail.Tier | str | None = None) -> jax.Array:
        return stack_forward(self.parameter_values(), hidden_states, config=self.config, mesh=self.mesh,
                             attention=attention, axis_name=self.axis_name, weight_layout=self.weight_layout,
                             tier=tier)


def random_stack_weights(config: StackConfig, *, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """(N per-layer checkpoints, pre_norm [N, H]): layer l ``random_checkpoint(config.layer, seed=seed + l)``."""
    checkpoints = [random_checkpoint(config.layer, seed=seed + index)
                   for index in range(config.num_layers)]
    rng = np.random.default_rng([seed, config.num_layers])  # a stream of its own, not any layer's seed
    spread = NORM_SCALE_STDDEV * rng.standard_normal((config.num_layers, config.hidden_size))
    return checkpoints, (1.0 + spread).astype(config.dtype)


def build_stack(config: StackConfig, mesh: Mesh, *, seed: int = 0, axis_name: str = "tp",
                weight_layout: str = "replicated") -> DecoderStack:
    """A :class:`DecoderStack` on ``mesh`` holding :func:`random_stack_weights` (``seed``)."""
    checkpoints, pre_norm = random_stack_weights(config, seed=seed)
    return DecoderStack(config, mesh, checkpoints, pre_norm, axis_name=axis_name, weight_layout=weight_layout)


def load_stack(checkpoint: str | os.PathLike | Checkpoint, layers: Sequence[int], *, config: StackConfig, mesh: Mesh,
               axis_name: str = "tp", weight_layout: str = "replicated") -> DecoderStack:
    """:class:`DecoderStack` of the decoder layers ``layers`` (N indices) of a Hugging Face checkpoint, each as
    ``load_layer`` loads it, its pre-norm from ``...layers.N.post_attention_layernorm.weight`` [H]. ValueError
    for another count, and as ``load_layer`` raises it; the pre-norms checked before any layer loads."""
    checkpoint = open_checkpoint(checkpoint)
    layers = tuple(layers)
    if len(layers) != config.num_layers:
        raise ValueError(f"layers: expected {config.num_layers} layer indices (config.num_layers), got {layers}")
    pre_norm = []
    for index in layers:
        checkpoint.moe_block(index)  # a dense layer or one past the last is named here
        name = checkpoint.layer_prefix(index) + PRE_NORM_TENSOR
        checkpoint.expect(name, (config.hidden_size,), config.dtype, layer=index,
                          what=f"[H] = [{config.hidden_size}]: the MoE layer's pre-norm scale")
        pre_norm.append(checkpoint.read(name))
    moe = [load_layer(checkpoint, index, config=config.layer, mesh=mesh, axis_name=axis_name,
                      weight_layout=weight_layout) for index in layers]
    return DecoderStack(config, mesh, moe, np.stack(pre_norm), axis_name=axis_name, weight_layout=weight_layout)


def reference_stack(checkpoints: Sequence[Mapping[str, np.ndarray]], pre_norm: np.ndarray, hidden_states: np.ndarray,
                    *, config: StackConfig, attention: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """h [T, H] after the N layers in float64; ``attention`` a numpy function of h before each layer."""
    tail = config.layer.tail
    h = np.asarray(hidden_states, np.float64)
    for weights, scale in zip(checkpoints, np.asarray(pre_norm, np.float64), strict=True):
        h = h if attention is None else np.asarray(attention(h), np.float64)
        normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + config.norm_eps) * scale
        h = h + reference_layer(weights, normed, top_k=config.layer.top_k, rms_norm_eps=tail.rms_norm_eps,
                                routed_scaling_factor=tail.routed_scaling_factor)
    return h


def main(argv: list[str] | None = None) -> int:
    """Times the Kimi-K3 decoder stack's step (N MoE layers, T tokens, random stand-in weights) with the tail tier
    the library selects against the same stack with an XLA tier forced, in interleaved rounds, and prints their
    median times and the ratio. On the CPU mesh (no GPU) it runs Kimi-K3's proportions at a 16th of the widths
    with 8 experts in seconds; on GPUs, the full widths with 64 experts (the flags change both)."""
    from k3_tail.cli.harness import Experiment, positive_int  # the harness, loaded for the command only
    from k3_tail.cli.tables import spread_ms
    from k3_tail.tools.benchmark import Timing, time_round_robin

    experiment = Experiment(main.__doc__, repeats=7, warmup=1)
    add = experiment.parser.add_argument
    add("--layers", type=positive_int, default=4, metavar="N", help="MoE layers in the stack (default: 4)")
    add("--tokens", type=positive_int, default=1, metavar="T", help="tokens per step (default: 1, decode)")
    add("--tier", type=k3_tail.Tier, default=k3_tail.Tier.COLUMN_PARALLEL, metavar="TIER",
        help=f"the tier forced in the baseline, one of {', '.join(t.value for t in k3_tail.Tier)} "
             "(default: column_parallel, an XLA tier)")
    add("--width-divisor", type=positive_int, metavar="D", help="Kimi-K3's widths divided by D (default: 16 on "
        "the CPU, 1 on GPUs)")
    add("--experts", type=positive_int, metavar="E", help="routed experts (default: 8 on the CPU, 64 on GPUs)")
    add("--top-k", type=positive_int, metavar="K", help="experts per token (default: 2 on the CPU, 16 on GPUs)")
    args = experiment.parse(argv)
    mesh = experiment.mesh()
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    try:
        layer = LayerConfig.kimi_k3(num_experts=args.experts or (8 if on_cpu else 64),
                                    top_k=args.top_k or (2 if on_cpu else 16),
                                    width_divisor=args.width_divisor or (16 if on_cpu else 1))
        config = StackConfig(layer, args.layers)
        partition_specs(layer, mesh.size)
    except ValueError as error:
        experiment.parser.error(f"--width-divisor, --experts, --top-k, --devices: {error}")
    if not args.tier.supports("replicated", layer.tail):
        experiment.parser.error(f"--tier: {args.tier.why_not('replicated', layer.tail)}")
    device = mesh.devices.flat[0]
    selected = k3_tail.select_tier(layer.tail, args.tokens, mesh.size, weight_layout="replicated",
                                   device_kind=device.device_kind, platform=device).tier
    if selected == args.tier:
        experiment.parser.error(f"--tier: {selected.value} is the tier selected at T = {args.tokens}; force another")
    # The N layers hold copies of one stand-in layer: the host draws one layer, and each step still reads N.
    checkpoints, pre_norm = random_stack_weights(dataclasses.replace(config, num_layers=1), seed=args.seed)
    stack = DecoderStack(config, mesh, checkpoints * args.layers, np.repeat(pre_norm, args.layers, axis=0))
    rng = np.random.default_rng(args.seed)
    hidden = jax.device_put(jnp.asarray(rng.standard_normal((args.tokens, config.hidden_size)), config.dtype),
                            NamedSharding(mesh, P()))
    parameters = stack.parameter_values()
    calls = {tier: functools.partial(stack_forward, parameters, hidden, config=config, mesh=mesh, tier=forced)
             for tier, forced in ((selected, None), (args.tier, args.tier))}
    seconds = time_round_robin(calls, rounds=args.repeats, warmup=args.warmup)
    timings = {tier: Timing.of(times) for tier, times in seconds.items()}
    experiment.print(
        f"{args.layers} layers, T = {args.tokens} on {mesh.size} x {mesh.devices.flat[0].device_kind}: H "
        f"{config.hidden_size}, L {layer.latent_size}, {layer.num_experts} experts, top {layer.top_k}, "
        f"{config.dtype.name}; {args.warmup} warm-up + {args.repeats} interleaved rounds, ms median (q25-q75)",
        f"  selected tier {selected.value:>16}: {spread_ms(timings[selected])}",
        f"  forced tier   {args.tier.value:>16}: {spread_ms(timings[args.tier])}",
        f"  forced / selected: {timings[args.tier].median_s / timings[selected].median_s:.2f}x")
    return experiment.finish(selected=selected, forced=args.tier, timings={t.value: v for t, v in timings.items()})


if __name__ == "__main__":
    raise SystemExit(main())
