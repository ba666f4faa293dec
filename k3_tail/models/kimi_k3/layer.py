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

Tensor parallelism (each parameter's partition spec is in :func:`partition_specs`):

- replicated: W_router [H, E], the correction bias [E] (float32), W_down [H, L] and g [L]: every
  rank routes every token and projects it down itself.
- routed experts: each expert's intermediate width m is split over the ranks, rank i holding
  G, U [E, L, m/p] and D [E, m/p, L]; its weighted sum over the chosen experts is the routed latent
  partial r_i, and sum_i r_i = r.
- shared experts: column-parallel in (G_s, U_s [H, F/p]), row-parallel out (D_s [F/p, H]): rank i
  ends with the shared partial s_i, and sum_i s_i = s.
- the tail: :func:`k3_tail.latent_moe_tail` on (r_i, s_i) per rank inside the layer's own
  ``jax.shard_map``, with W_up whole on every rank ("replicated", vLLM's layout) or in column blocks
  [L, H/p] ("column"); in FP8 with per-column scales (sharded with its columns) when the tail config's
  ``up_proj_dtype`` says so. Its collectives are the layer's only ones.

Held (:func:`held_parameters`): the four kernels that multiply x, W_router, W_down and the rank's blocks of G_s
and U_s, are packed at load into one per-rank ``input_kernel`` [H, E + L + 2F/p] (:func:`pack_parameters`), so
one GEMM reads x for all of them; each rank is also given its index (``rank``), so the compiled layer holds no
partition-id. :meth:`KimiK3MoELayer.checkpoint_values` gives the checkpoint's arrays back, which hold no trace
of p (:func:`~k3_tail.models.kimi_k3.restore_layer` restores them at any p).

Kimi-K3's two shared experts (SiTU MLPs of width 3072 each) are one MLP of width F = 6144 here:
their gate and up kernels concatenated along the intermediate width and their down kernels along
its rows. That is the same function, because SiTU acts on each intermediate channel alone, and it is
how maxtext's Kimi-K3 block stores them.

The routed experts, per rank, take one of the methods of k3_tail/models/kimi_k3/routed_experts.py, picked
by :func:`routed_expert_method` with its reason:

- "gather" while T * k <= E (decode): for each (token, slot) the chosen expert's blocks are read in
  place and applied as a multiply + reduce XLA fuses, so the [T, k, L, m/p] blocks are never copied.
  That reads T*k expert blocks, at most the E blocks all experts hold, and needs no sort. On a GPU the
  router's top-k and the method run as two Pallas kernels (:mod:`.decode_experts`): the layer's decode is
  then 8 GPU kernels besides its collectives on H100, MI300X and MI355X.
- "capacity" above (prefill): the T*k pairs sorted by expert, each expert's first C pairs in one
  batched GEMM over all E experts with the weights read in place, once, and the pairs beyond C in
  overflow rounds: exact for any routing, at about CAPACITY_FACTOR (1.25) times the useful FLOPs.
- "ragged_dot" (by name only): ``jax.lax.ragged_dot``, which jax 0.10.2 computes densely over all E
  experts on CPU and in XLA's default GPU pipeline (E times the useful FLOPs).

MXFP4 experts (``LayerConfig(expert_quantization="mxfp4")``, as the released Kimi-K3 ships them): each
routed kernel is held packed, its E2M1 codes two per byte and one E8M0 scale per 32 input rows (the
format: :mod:`.mxfp4`; the kernels: :mod:`.mxfp4_experts`), under the same names and partition
specs, with a scale parameter beside each (``ROUTED_EXPERT_SCALES``): ``expert_gate``, ``expert_up``
uint8 [E, L/2, m] with ``expert_gate_scale``, ``expert_up_scale`` [E, L/32, m], ``expert_down`` uint8
[E, m/2, L] with ``expert_down_scale`` [E, m/32, L]. The routed-expert methods decode them exactly to the
layer's dtype where they use them: 0.53 bytes per weight held instead of 2.

Numerics: weights and activations in ``config.tail.dtype`` (Kimi-K3: bf16), every GEMM accumulating
in float32, the router, SiTU and the weighted sum in float32; activations are rounded to the dtype
where they enter a GEMM (z, the SiTU outputs) and where the partials enter the tail. Every GEMM is
``k3_tail.models.kimi_k3.gemm.matmul``, which multiplies a single row (T = 1) as two, so that XLA's GPU
pipeline keeps it a GEMM that reads its kernel in place (docs/design.md, "One-row GEMMs").

Per-rank cost, d bytes per element: the input GEMM 2TH(E + L + 2F/p) FLOPs over dH(E + L + 2F/p) weight
bytes (router, down projection, shared gate and up); routed experts 6TkLm/p over 3dLm/p per expert read
(gather: T*k of them; capacity: all E, once; MXFP4 experts: d = 0.53125 held, plus what XLA writes of their
decoding, :mod:`.mxfp4_experts`); the shared experts' down projection 2THF/p over dHF/p; then the tail tier's
(README tier table).

``KimiK3MoELayer`` holds the packed parameters as ``nnx.Param`` (``build_layer``: random stand-ins for a
checkpoint; k3_tail/models/kimi_k3/checkpoint.py: a layer of a Hugging Face checkpoint); :func:`layer_forward`
is the jitted pure function it calls, which also compiles from abstract parameters
(:func:`abstract_parameters`) for a deviceless GPU topology: :func:`compile_layer`, with the
per-executable XLA options of :func:`layer_compiler_options`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import k3_tail
from k3_tail.models.kimi_k3 import mxfp4, mxfp4_experts as kimi_k3_mxfp4
from k3_tail.models.kimi_k3.cost import MoELayerSizes
from k3_tail.models.kimi_k3.decode_experts import decode_experts
from k3_tail.models.kimi_k3.gemm import matmul
from k3_tail.models.kimi_k3.routed_experts import ROUTED_EXPERTS, routed_expert_method
from k3_tail.models.kimi_k3.situ import situ
from k3_tail.tools.blocks import WEIGHT_LAYOUTS
from k3_tail.xla.compilation import compiler_options

KIMI_K3_NUM_EXPERTS, KIMI_K3_TOP_K = 896, 16
# The parameters that hold the routed experts' weights (what k3_tail.models.kimi_k3.schedule traces); with MXFP4
# experts they hold the packed codes, and each has its scales beside it, named here.
ROUTED_EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")
ROUTED_EXPERT_SCALES = {name: f"{name}_scale" for name in ROUTED_EXPERT_WEIGHTS}
# The four kernels that multiply the hidden states, packed at load into one per-rank kernel (INPUT_KERNEL) in
# this order, so that one GEMM reads x once for all of them: [H, E | L | F/p | F/p] per rank.
INPUT_WEIGHTS = ("router_kernel", "down_proj", "shared_gate", "shared_up")
INPUT_KERNEL = "input_kernel"
# Each rank's index along the TP axis, int32 [p] sharded over it: a program argument, so that no partition-id
# (and no kernel converting it) is left in the compiled layer for the tail's one-kernel tier.
RANK = "rank"
# The arrays a decoder stack hands each layer whole, with their leading axis of layers, and the layer's index:
# the routed experts' kernels read them in place (a scan's slice of them would be a copy of the layer's experts).
STACKED_IN_PLACE = (*ROUTED_EXPERT_WEIGHTS, *ROUTED_EXPERT_SCALES.values())
# LayerConfig.expert_quantization's values: None (experts in the layer's dtype) or MXFP4.
EXPERT_QUANTIZATIONS = (None, "mxfp4")
KIMI_K3_EXPERT_INTERMEDIATE_SIZE, KIMI_K3_SHARED_INTERMEDIATE_SIZE = 3072, 6144
# The stand-in checkpoint's correction bias and norm scale: spread enough that the bias changes some
# top-k choices and the scale is not all ones, as in a trained layer.
ROUTER_BIAS_STDDEV, NORM_SCALE_STDDEV = 0.1, 0.1
# XLA options of every GPU compile of the layer (layer_compiler_options), beside the tail tier's own. XLA's
# latency-hiding scheduler is what keeps the early shared reduction in flight over the routed experts, and
# jax 0.10.2's ROCm pipeline runs it only when asked: without it, a prefill's reduction (T = 2048, 8192) starts
# after all routed work on MI300X and MI355X. Command buffers keep XLA's default command types, which hold no
# collective on jax 0.10.2 and 0.12 (docs/guide.md, "ROCm graphs and collectives"; tests/test_command_buffers.py).
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The layer's shapes; ``tail`` holds H, L, the norm's eps, c, the dtype and the tail's switches.

    num_experts E and top_k k of the router; each routed expert maps L -> expert_intermediate_size (m)
    -> L, the shared experts H -> shared_intermediate_size (F) -> H. p must divide m and F. Frozen
    and hashable, like ``TailConfig``.

    routed_experts: the routed-expert method every call takes (a key of ``ROUTED_EXPERTS``: "gather",
    "capacity", "ragged_dot"), or None (default) to let :func:`routed_expert_method` pick by T.

    early_shared_reduction (default True): the shared experts run before the routed ones and their
    partials are summed (``k3_tail.reduce_shared``) while the routed experts compute; the tail takes
    the reduced output. False keeps the shared reduction inside the tail, where only the up projection
    can hide it. ``tail.shared_output_is_reduced`` is set here to follow it.

    expert_quantization: None (default), the routed experts in ``tail.dtype``; "mxfp4", held packed as
    MXFP4 and decoded where used (module docstring). MXFP4 needs L and m multiples of 32 (its groups)
    and a bfloat16 or float32 dtype (where every MXFP4 value is exact).
    """

    tail: k3_tail.TailConfig
    num_experts: int = 8
    top_k: int = 2
    expert_intermediate_size: int = KIMI_K3_EXPERT_INTERMEDIATE_SIZE
    shared_intermediate_size: int = KIMI_K3_SHARED_INTERMEDIATE_SIZE
    routed_experts: str | None = None
    early_shared_reduction: bool = True
    expert_quantization: str | None = None

    def __post_init__(self):
        if not isinstance(self.tail, k3_tail.TailConfig):
            raise ValueError(f"tail: expected a k3_tail.TailConfig, got {type(self.tail).__name__}")
        tail = self.tail
        if not tail.has_shared_experts or not tail.use_latent_norm or tail.routed_output_is_reduced:
            raise ValueError("tail: the layer has shared experts, the latent norm and unreduced routed partials; "
                             "expected has_shared_experts=True, use_latent_norm=True, routed_output_is_reduced=False")
        if self.routed_experts is not None and self.routed_experts not in ROUTED_EXPERTS:
            raise ValueError(f"routed_experts: expected None or one of {tuple(ROUTED_EXPERTS)}, "
                             f"got {self.routed_experts!r}")
        if not isinstance(self.early_shared_reduction, bool):
            raise ValueError(f"early_shared_reduction: expected a bool, got {self.early_shared_reduction!r}")
        # The layer decides where its shared output is reduced; its tail is told.
        tail = dataclasses.replace(tail, shared_output_is_reduced=self.early_shared_reduction)
        object.__setattr__(self, "tail", tail)
        for name in ("num_experts", "top_k", "expert_intermediate_size", "shared_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: expected at most num_experts = {self.num_experts}, got {self.top_k}")
        if self.expert_quantization not in EXPERT_QUANTIZATIONS:
            raise ValueError(f"expert_quantization: expected one of {EXPERT_QUANTIZATIONS}, "
                             f"got {self.expert_quantization!r}")
        if self.expert_quantization == "mxfp4":
            if tail.dtype not in mxfp4.DECODED_DTYPES:
                raise ValueError(f"tail: MXFP4 experts decode to {tuple(d.name for d in mxfp4.DECODED_DTYPES)}, "
                                 f"got dtype {tail.dtype.name}")
            for name, width in (("latent_size", tail.latent_size),
                                ("expert_intermediate_size", self.expert_intermediate_size)):
                if width % mxfp4.GROUP_SIZE:
                    raise ValueError(f"{name}: MXFP4 experts need a multiple of {mxfp4.GROUP_SIZE} (one scale per "
                                     f"{mxfp4.GROUP_SIZE} input columns), got {width}")

    @classmethod
    def kimi_k3(cls, *, num_experts: int = 8, top_k: int = 2, width_divisor: int = 1,
                routed_experts: str | None = None, early_shared_reduction: bool = True,
                expert_quantization: str | None = None, **tail_overrides: Any) -> LayerConfig:
        """Kimi-K3's widths (H 7168, L 3584, m 3072, F 6144, bf16; the tail's eps 1e-5 and the rest of
        ``k3_tail.TailConfig.kimi_k3``), each divided by ``width_divisor`` (a
        smaller layer of the same proportions, for a CPU), with ``num_experts`` experts, ``top_k`` per
        token (small by default; Kimi-K3 routes to KIMI_K3_TOP_K of KIMI_K3_NUM_EXPERTS). ValueError
        naming ``width_divisor`` unless it divides every width."""
        kimi = k3_tail.TailConfig.kimi_k3()
        widths = (kimi.hidden_size, kimi.latent_size, KIMI_K3_EXPERT_INTERMEDIATE_SIZE,
                  KIMI_K3_SHARED_INTERMEDIATE_SIZE)
        if isinstance(width_divisor, bool) or not isinstance(width_divisor, int) or width_divisor < 1 \
                or any(width % width_divisor for width in widths):
            raise ValueError(f"width_divisor: expected a positive divisor of Kimi-K3's widths {widths}, "
                             f"got {width_divisor!r}")
        hidden, latent, expert, shared = (width // width_divisor for width in widths)
        tail = k3_tail.TailConfig.kimi_k3(**{"hidden_size": hidden, "latent_size": latent, **tail_overrides})
        return cls(tail, num_experts=num_experts, top_k=top_k, expert_intermediate_size=expert,
                   shared_intermediate_size=shared, routed_experts=routed_experts,
                   early_shared_reduction=early_shared_reduction, expert_quantization=expert_quantization)

    @property
    def sizes(self) -> MoELayerSizes:
        """The layer's sizes, as the cost tools take them (:mod:`k3_tail.models.kimi_k3.cost`)."""
        return MoELayerSizes(self.tail, self.num_experts, self.top_k, self.expert_intermediate_size,
                             self.shared_intermediate_size, self.early_shared_reduction)

    @property
    def hidden_size(self) -> int:
        return self.tail.hidden_size

    @property
    def latent_size(self) -> int:
        return self.tail.latent_size

    @property
    def dtype(self) -> np.dtype:
        return self.tail.dtype


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One parameter as a checkpoint holds it: its global shape and dtype, and the normal distribution
    (``mean``, ``stddev``) its stand-in value is drawn from."""

    shape: tuple[int, ...]
    dtype: np.dtype
    stddev: float
    mean: float = 0.0


def layer_parameters(config: LayerConfig) -> dict[str, Parameter]:
    """Every parameter of the layer, by name, in Flax layout (y = x @ W).

    Kernels are drawn with variance 1 / fan-in, so every GEMM output has about unit scale. The
    correction bias (float32) and the norm scale are spread (``ROUTER_BIAS_STDDEV``,
    ``NORM_SCALE_STDDEV``) so that the bias changes some top-k choices and the scale is not all ones.
    With an FP8 ``config.tail.up_proj_dtype`` the up projection is its FP8 values [L, H] and their
    float32 scales ``up_proj_scale`` [H] (``k3_tail.quantize_up_proj`` of the checkpoint's kernel).
    With MXFP4 experts each routed kernel [E, K, N] is its packed codes uint8 [E, K/2, N] (``stddev``
    that of the decoded values) and ``<name>_scale`` uint8 [E, K/32, N] (made with the codes).
    """
    hidden, latent, experts, dtype = config.hidden_size, config.latent_size, config.num_experts, config.dtype
    expert_width, shared_width = config.expert_intermediate_size, config.shared_intermediate_size

    def kernel(*shape, fan_in):
        return Parameter(shape, dtype, fan_in ** -0.5)

    def expert_kernel(name, *shape, fan_in):
        if config.expert_quantization is None:
            return {name: kernel(*shape, fan_in=fan_in)}
        *leading, rows, columns = shape
        codes = np.dtype(np.uint8)
        return {name: Parameter((*leading, rows // mxfp4.CODES_PER_BYTE, columns), codes, fan_in ** -0.5),
                ROUTED_EXPERT_SCALES[name]: Parameter((*leading, rows // mxfp4.GROUP_SIZE, columns), codes, 0.0)}

    up_proj_dtype = config.tail.up_proj_dtype
    up_projection = {"up_proj_kernel": kernel(latent, hidden, fan_in=latent)}
    if up_proj_dtype is not None:
        up_projection = {"up_proj_kernel": Parameter((latent, hidden), up_proj_dtype, latent ** -0.5),
                         "up_proj_scale": Parameter((hidden,), np.dtype(np.float32), 0.0)}  # made by quantising
    return {
        "router_kernel": kernel(hidden, experts, fan_in=hidden),
        "router_bias": Parameter((experts,), np.dtype(np.float32), ROUTER_BIAS_STDDEV),
        "down_proj": kernel(hidden, latent, fan_in=hidden),
        **expert_kernel("expert_gate", experts, latent, expert_width, fan_in=latent),
        **expert_kernel("expert_up", experts, latent, expert_width, fan_in=latent),
        **expert_kernel("expert_down", experts, expert_width, latent, fan_in=expert_width),
        "shared_gate": kernel(hidden, shared_width, fan_in=hidden),
        "shared_up": kernel(hidden, shared_width, fan_in=hidden),
        "shared_down": kernel(shared_width, hidden, fan_in=shared_width),
        "norm_scale": Parameter((latent,), dtype, NORM_SCALE_STDDEV, mean=1.0),
        **up_projection,
    }


def partition_specs(config: LayerConfig, tp_size: int, *, axis_name: str = "tp",
                    weight_layout: str = "replicated") -> dict[str, P]:
    """How the TP ranks hold each parameter (module docstring), by name; an MXFP4 scale as its kernel.

    ValueError unless p divides what it splits: m, F, and H for the column layout (the tail's column
    tiers would otherwise want the kernel stored padded; Kimi-K3's widths divide by 1, 2, 4, 8, 16);
    with MXFP4 experts, unless 32 p divides m, so that each rank's rows of the down kernel are whole
    groups of 32 under one scale (Kimi-K3's m = 3072: p up to 96).
    """
    splits = {"expert_intermediate_size": config.expert_intermediate_size,
              "shared_intermediate_size": config.shared_intermediate_size}
    if weight_layout == "column":
        splits["hidden_size"] = config.hidden_size
    elif weight_layout != "replicated":
        raise ValueError(f"weight_layout: expected one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    for name, width in splits.items():
        if width % tp_size:
            raise ValueError(f"{name}: expected a multiple of the TP size {tp_size}, got {width}")
    if config.expert_quantization == "mxfp4" and config.expert_intermediate_size % (mxfp4.GROUP_SIZE * tp_size):
        raise ValueError(f"expert_intermediate_size: MXFP4 experts split over {tp_size} ranks need a multiple of "
                         f"{mxfp4.GROUP_SIZE} x {tp_size} = {mxfp4.GROUP_SIZE * tp_size} (each rank's rows of "
                         f"expert_down whole groups of {mxfp4.GROUP_SIZE}), got {config.expert_intermediate_size}")
    tp = axis_name
    column = weight_layout == "column"
    specs = {
        "router_kernel": P(), "router_bias": P(), "down_proj": P(),
        "expert_gate": P(None, None, tp), "expert_up": P(None, None, tp), "expert_down": P(None, tp, None),
        "shared_gate": P(None, tp), "shared_up": P(None, tp), "shared_down": P(tp, None),
        "norm_scale": P(), "up_proj_kernel": P(None, tp) if column else P(),
    }
    if config.tail.up_proj_dtype is not None:
        specs["up_proj_scale"] = P(tp) if column else P()
    if config.expert_quantization is not None:
        specs.update({scale: specs[name] for name, scale in ROUTED_EXPERT_SCALES.items()})
    return specs


def held_parameters(config: LayerConfig, tp_size: int) -> dict[str, Parameter]:
    """Every array :func:`layer_forward` takes (what :class:`KimiK3MoELayer` holds), by name: the checkpoint's
    (:func:`layer_parameters`) with :data:`INPUT_WEIGHTS` packed into ``input_kernel`` [H, p W], W = E + L + 2F/p
    (rank i's block [H, W]: router, down projection, and its blocks of the shared gate and up kernels), and
    ``rank`` int32 [p] (:func:`pack_parameters`)."""
    checkpoint = layer_parameters(config)
    width = config.num_experts + config.latent_size + 2 * config.shared_intermediate_size // tp_size
    held = {name: parameter for name, parameter in checkpoint.items() if name not in INPUT_WEIGHTS}
    held[INPUT_KERNEL] = Parameter((config.hidden_size, tp_size * width), config.dtype, 0.0)
    held[RANK] = Parameter((tp_size,), np.dtype(np.int32), 0.0)
    return held


def held_partition_specs(config: LayerConfig, tp_size: int, *, axis_name: str = "tp",
                         weight_layout: str = "replicated") -> dict[str, P]:
    """The partition spec of every array :func:`layer_forward` takes (:func:`held_parameters`), by name."""
    specs = partition_specs(config, tp_size, axis_name=axis_name, weight_layout=weight_layout)
    held = {name: spec for name, spec in specs.items() if name not in INPUT_WEIGHTS}
    return held | {INPUT_KERNEL: P(None, axis_name), RANK: P(axis_name)}


def pack_parameters(checkpoint: Mapping[str, jax.Array], config: LayerConfig, mesh: Mesh, *, axis_name: str = "tp",
                    weight_layout: str = "replicated") -> dict[str, jax.Array]:
    """The arrays :func:`layer_forward` takes from the checkpoint's (global arrays by the names of
    :func:`layer_parameters`, of their shapes and dtypes): each rank concatenates its blocks of
    :data:`INPUT_WEIGHTS` where they lie (no collective; a transient copy of them), and ``rank`` is each rank's
    index. The inverse is :func:`unpack_parameters`."""
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
    """The checkpoint's arrays (:func:`layer_parameters`' names, global) from what :func:`pack_parameters` made:
    the router and down projection from rank 0's block (every rank holds the same), the shared kernels' blocks
    in rank order, replicated. Copies what it slices."""
    experts, latent = config.num_experts, config.latent_size
    shared = config.shared_intermediate_size // tp_size
    kernel = held[INPUT_KERNEL]
    # Replicated first: the slices below then read no other rank's block (and an Explicit mesh types them).
    blocks = jax.device_put(kernel, NamedSharding(kernel.sharding.mesh, P())).reshape(config.hidden_size, tp_size, -1)
    bounds = np.cumsum([0, experts, latent, shared, shared])
    router, down, gate, up = (blocks[:, :, start:stop] for start, stop in zip(bounds[:-1], bounds[1:], strict=True))
    unpacked = {"router_kernel": router[:, 0], "down_proj": down[:, 0],
                "shared_gate": gate.reshape(config.hidden_size, -1), "shared_up": up.reshape(config.hidden_size, -1)}
    return {name: value for name, value in held.items() if name not in (INPUT_KERNEL, RANK)} | unpacked


def random_checkpoint(config: LayerConfig, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Stand-in weights for a checkpoint, by name, each in its dtype: drawn on the host with numpy, so
    nothing is compiled (XLA's CPU compiler takes seconds per ``jax.random.normal`` shape). With an FP8
    up projection the kernel is drawn in the layer's dtype, as the checkpoint ships it, and quantised
    (``k3_tail.quantize_up_proj``: values and per-column scales), as a server does at load. MXFP4
    experts are random codes with one scale per kernel (``kimi_k3_mxfp4.random_codes``), of the bf16 kernels' spread."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in layer_parameters(config).items():
        if name == "up_proj_scale" or name in ROUTED_EXPERT_SCALES.values():
            continue  # made with the quantised kernel, or with the packed codes
        if config.expert_quantization is not None and name in ROUTED_EXPERT_WEIGHTS:
            *leading, half, columns = p.shape
            weights[name], weights[ROUTED_EXPERT_SCALES[name]] = kimi_k3_mxfp4.random_codes(
                rng, (*leading, half * mxfp4.CODES_PER_BYTE, columns), p.stddev)
            continue
        value = p.mean + p.stddev * rng.standard_normal(p.shape, dtype=np.float32)
        if name == "up_proj_kernel" and config.tail.up_proj_dtype is not None:
            quantized = k3_tail.quantize_up_proj(value.astype(config.dtype), config.tail.up_proj_dtype)
            weights[name], weights["up_proj_scale"] = np.asarray(quantized.values), np.asarray(quantized.scale)
        else:
            weights[name] = value.astype(p.dtype)
    return weights


def abstract_parameters(config: LayerConfig, mesh: Mesh, *, axis_name: str = "tp",
                        weight_layout: str = "replicated") -> dict[str, jax.ShapeDtypeStruct]:
    """Every array :func:`layer_forward` takes (:func:`held_parameters`) as a ``jax.ShapeDtypeStruct`` placed on
    ``mesh``: to lower and compile
    :func:`layer_forward` without values (also on a deviceless topology, ``k3_tail.topology_mesh``)."""
    tp_size = mesh.shape[axis_name]
    specs = held_partition_specs(config, tp_size, axis_name=axis_name, weight_layout=weight_layout)
    return {name: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, specs[name]))
            for name, p in held_parameters(config, tp_size).items()}


def route(hidden_states: jax.Array, router_kernel: jax.Array, correction_bias: jax.Array, *,
          top_k: int) -> tuple[jax.Array, jax.Array]:
    """(chosen [T, k] expert ids, combine weights [T, k] float32) of hidden_states [T, H].

    The bias is added to the sigmoid scores only to choose the top k; the combine weights are the
    chosen experts' un-biased scores, renormalised to sum 1 per token when top_k > 1 (at top_k = 1 the
    one weight is the expert's score itself, as in Kimi-K3's reference, MaxText and tpu-inference).
    """
    return route_logits(matmul(hidden_states, router_kernel), correction_bias, top_k=top_k)


def route_logits(logits: jax.Array, correction_bias: jax.Array, *, top_k: int) -> tuple[jax.Array, jax.Array]:
    """:func:`route` from the router's logits [T, E] float32 (x @ W_router)."""
    scores = jax.nn.sigmoid(logits)
    _, chosen = jax.lax.top_k(scores + correction_bias, top_k)
    picked = scores[jnp.arange(scores.shape[0])[:, None], chosen]
    return chosen, picked / picked.sum(axis=1, keepdims=True) if top_k > 1 else picked


class InputProducts(NamedTuple):
    """The products of the hidden states x [T, H] with this rank's ``input_kernel``, split by kernel, float32: the
    router's logits [T, E], the routed latent z [T, L] (rounded to the dtype where the experts take it) and the
    rank's shared gate and up products [T, F/p]."""

    logits: jax.Array
    latent: jax.Array
    shared_gate: jax.Array
    shared_up: jax.Array


def input_products(parameters: Mapping[str, jax.Array], hidden_states: jax.Array) -> jax.Array:
    """x @ input_kernel, float32 [T, W], W = E + L + 2F/p (:func:`split_products` names its columns). Per rank,
    inside a shard_map: ``parameters`` are this rank's blocks, ``hidden_states`` [T, H] the whole (replicated)
    input. 2 T H W FLOPs over d H W weight bytes: one GEMM, no collective."""
    return matmul(hidden_states, parameters[INPUT_KERNEL])


def split_products(products: jax.Array, config: LayerConfig) -> InputProducts:
    """:func:`input_products`' columns by kernel (slices, which XLA fuses into their consumers)."""
    experts, latent = config.num_experts, config.latent_size
    shared = (products.shape[1] - experts - latent) // 2
    bounds = np.cumsum([0, experts, latent, shared, shared])
    logits, latent, gate, up = (products[:, start:stop] for start, stop in zip(bounds[:-1], bounds[1:], strict=True))
    return InputProducts(logits, latent.astype(config.dtype), gate, up)


def routed_inputs(products: jax.Array, config: LayerConfig) -> jax.Array | InputProducts:
    """What the routed experts read of the :func:`input_products`: at decode (the gather method) the products as
    they are, where a GPU's kernels read the logits and z; else only the logits and z, split (what the layer
    carries past the early shared reduction is then no more than those two)."""
    if routed_expert_method(config, products.shape[0]).method == "gather":
        return products
    split = split_products(products, config)
    return split._replace(shared_gate=None, shared_up=None)


def routed_partial(parameters: Mapping[str, jax.Array], products: jax.Array | InputProducts, *, config: LayerConfig,
                   layer_index: jax.Array | None = None) -> jax.Array:
    """This rank's routed latent partial r_i [T, L] in the config's dtype: the router's choice and the routed
    experts on the :func:`input_products` (or their split, :func:`routed_inputs`). ``layer_index``: given, the
    :data:`STACKED_IN_PLACE` arrays hold every layer of a stack [N, ...] and this is the layer's index. No
    collective."""
    split_first = isinstance(products, InputProducts)
    method = routed_expert_method(config, (products.logits if split_first else products).shape[0]).method
    kernels = routed_expert_kernels(parameters)

    quantized = tuple(isinstance(kernel, kimi_k3_mxfp4.Mxfp4Kernel) for kernel in kernels)

    def in_xla_at(layer, products, bias, *arrays):
        if layer is not None:
            arrays = [array[layer] for array in arrays]
        split = products if split_first else split_products(products, config)
        chosen, combine = route_logits(split.logits, bias, top_k=config.top_k)
        routed = ROUTED_EXPERTS[method](split.latent, chosen, combine, *_as_kernels(quantized, arrays))
        return routed.astype(config.dtype)

    # Differentiated as XLA's route: the Pallas kernels compute its function and have no derivative rule of their own.
    @jax.custom_vjp
    def in_two_kernels_at(layer, products, bias, *arrays):
        return decode_experts(products, bias, *_as_kernels(quantized, arrays), num_experts=config.num_experts,
                              top_k=config.top_k, dtype=config.dtype, layer=layer)

    def forward(layer, products, bias, *arrays):
        return in_two_kernels_at(layer, products, bias, *arrays), (layer, products, bias, arrays)

    def backward(residuals, cotangent):
        layer, products, bias, arrays = residuals
        floating = [jnp.issubdtype(array.dtype, jnp.floating) for array in arrays]

        def of_floats(products, bias, *floats):
            floats = iter(floats)
            every = [next(floats) if is_float else array for array, is_float in zip(arrays, floating, strict=True)]
            return in_xla_at(layer, products, bias, *every)

        _, vjp = jax.vjp(of_floats, products, bias, *[a for a, f in zip(arrays, floating, strict=True) if f])
        products_bar, bias_bar, *floats_bar = vjp(cotangent)
        floats_bar = iter(floats_bar)
        return (None, products_bar, bias_bar, *[next(floats_bar) if is_float else None for is_float in floating])

    in_two_kernels_at.defvjp(forward, backward)
    arrays = [array for kernel in kernels for array in kimi_k3_mxfp4.kernel_arrays(kernel)]
    if method != "gather" or split_first:
        return in_xla_at(layer_index, products, parameters["router_bias"], *arrays)
    # At decode a GPU routes and runs the experts in two Pallas kernels (decode_experts); elsewhere XLA's gather.
    return jax.lax.platform_dependent(layer_index, products, parameters["router_bias"], *arrays,
                                      cuda=in_two_kernels_at, rocm=in_two_kernels_at, default=in_xla_at)


def routed_expert_kernels(parameters: Mapping[str, jax.Array]) -> tuple[jax.Array | kimi_k3_mxfp4.Mxfp4Kernel, ...]:
    """(gate, up, down) as the routed-expert methods take them: the arrays, or MXFP4 codes with their scales."""
    if ROUTED_EXPERT_SCALES["expert_gate"] in parameters:
        return tuple(kimi_k3_mxfp4.Mxfp4Kernel(parameters[name], parameters[scale])
                     for name, scale in ROUTED_EXPERT_SCALES.items())
    return tuple(parameters[name] for name in ROUTED_EXPERT_WEIGHTS)


def _as_kernels(quantized, arrays) -> list:
    """The expert kernels rebuilt on ``arrays`` (their arrays, in order): MXFP4 where ``quantized`` says so."""
    arrays, rebuilt = iter(arrays), []
    for is_mxfp4 in quantized:
        if is_mxfp4:
            rebuilt.append(kimi_k3_mxfp4.Mxfp4Kernel(next(arrays), next(arrays)))
        else:
            rebuilt.append(next(arrays))
    return rebuilt


def shared_partial(parameters: Mapping[str, jax.Array], products: jax.Array, *, config: LayerConfig) -> jax.Array:
    """This rank's shared-expert partial s_i [T, H] in the config's dtype, from its gate and up products among the
    :func:`input_products`. No collective."""
    split = split_products(products, config)
    activation = situ(split.shared_gate, split.shared_up).astype(config.dtype)
    return matmul(activation, parameters["shared_down"]).astype(config.dtype)


def rank_partials(parameters: Mapping[str, jax.Array], hidden_states: jax.Array, *,
                  config: LayerConfig) -> tuple[jax.Array, jax.Array]:
    """(routed latent partial r_i [T, L], shared partial s_i [T, H]) of this rank, in the config's dtype
    (:func:`routed_partial`, :func:`shared_partial`). No collective."""
    products = input_products(parameters, hidden_states)
    return (routed_partial(parameters, products, config=config),
            shared_partial(parameters, products, config=config))


def layer_per_rank(parameters: Mapping[str, jax.Array], hidden_states: jax.Array, *, config: LayerConfig,
                   axis_name: str, weight_layout: str, tier: k3_tail.Tier | str | None,
                   device: jax.Device, layer_index: jax.Array | None = None) -> jax.Array:
    """This rank's y: its partials, then ``k3_tail.latent_moe_tail`` on them (given the rank's index).

    With ``config.early_shared_reduction`` the shared experts run first and ``k3_tail.reduce_shared``
    sums their partials while the routed experts compute; the tail then takes the reduced shared
    output (``TailConfig.shared_output_is_reduced``). Two ordering barriers (they order values and
    emit no kernel) make XLA's schedule keep the reduction around the routed experts: the routed
    experts' inputs wait for the shared partial, and the routed partial waits for the reduced
    shared output, so the tail cannot start before both are done.

    ``layer_index``: in a decoder stack, the layer's index, the :data:`STACKED_IN_PLACE` arrays holding every
    layer's (:func:`routed_partial`).

    Returns [T, H], or with sequence-parallel output this rank's [T'/p, H] rows of y padded to
    T' = ``k3_tail.padded_token_count(T, p)`` rows (``k3_tail.is_token_sharded_output``).
    """
    products = input_products(parameters, hidden_states)
    shared = shared_partial(parameters, products, config=config)
    routed_in = routed_inputs(products, config)
    if config.early_shared_reduction:
        routed_in, shared = jax.lax.optimization_barrier((routed_in, shared))
        shared = k3_tail.reduce_shared(shared, config=config.tail, axis_name=axis_name, device=device)
    routed = routed_partial(parameters, routed_in, config=config, layer_index=layer_index)
    if config.early_shared_reduction:
        routed, _ = jax.lax.optimization_barrier((routed, shared))
    return k3_tail.latent_moe_tail(routed, shared, parameters["norm_scale"], up_projection(parameters),
                                   config=config.tail, axis_name=axis_name, weight_layout=weight_layout, tier=tier,
                                   device=device, rank=parameters[RANK])


def up_projection(parameters: Mapping[str, jax.Array]) -> jax.Array | k3_tail.QuantizedKernel:
    """The up projection as the tail takes it: the kernel, or its FP8 values with their scales."""
    if "up_proj_scale" in parameters:
        return k3_tail.QuantizedKernel(parameters["up_proj_kernel"], parameters["up_proj_scale"])
    return parameters["up_proj_kernel"]


@functools.partial(jax.jit, static_argnames=("config", "mesh", "axis_name", "weight_layout", "tier"))
def layer_forward(parameters: Mapping[str, jax.Array], hidden_states: jax.Array, *, config: LayerConfig,
                  mesh: Mesh, axis_name: str = "tp", weight_layout: str = "replicated",
                  tier: k3_tail.Tier | str | None = None) -> jax.Array:
    """y [T, H] of the layer for hidden_states [T, H], as one ``jax.shard_map`` over ``mesh``.

    ``parameters``: global arrays by the names of :func:`held_parameters` (:func:`pack_parameters` of a
    checkpoint; placed here as :func:`held_partition_specs` says, a no-op for arrays already there).
    ``tier``: force a tail tier, or None to let the tail select one for T (``k3_tail.select_tier``).
    y is replicated (``P()``), or with
    sequence-parallel output (``k3_tail.is_token_sharded_output``) padded to T' rows
    (``k3_tail.padded_token_count(T, p)``), [T', H], token-sharded over ``axis_name``, the padding rows
    zero. Jitted: compiled once
    per T, placement and static argument; ``.lower(...)`` takes :func:`abstract_parameters`.
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
    """The per-executable XLA options of a :func:`layer_forward` compile for T tokens on ``mesh``: those of the
    tail tier the call takes (``tier``, or the one ``k3_tail.select_tier`` picks for the mesh's devices, as the
    tail does; ``k3_tail.xla.compilation.compiler_options``) and, on a GPU, :data:`GPU_COMPILER_OPTIONS`."""
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
    """:func:`layer_forward` for T tokens compiled from :func:`abstract_parameters` (no values: also for a
    deviceless GPU topology, ``k3_tail.topology_mesh``) with :func:`layer_compiler_options`, and over them
    ``xla_options`` (``{"xla_dump_to": directory}`` for XLA's dump of the compile)."""
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
    """(routed [p, T, L], shared [p, T, H]): every rank's partials stacked, sharded over ``axis_name``:
    the tail's inputs as ``k3_tail.tail_forward`` takes them. Arguments as :func:`layer_forward`."""
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

    ``checkpoint``: every parameter of :func:`layer_parameters` by name, as numpy or jax arrays of its
    global shape (cast to its dtype; MXFP4 codes and scales must be uint8 already, as no cast makes
    them); each is placed as :func:`partition_specs` says, so a rank receives only its block (a jax array
    already placed so, as :func:`~k3_tail.models.kimi_k3.load_layer` loads them, stays where it is), and the
    kernels that multiply the hidden states are packed into one per rank (:func:`pack_parameters`). The Params
    are what :func:`layer_forward` takes (:func:`held_parameters`), with their specs as sharding metadata
    (``nnx.get_partition_spec``); the ranks' indices are an ``nnx.Variable`` of their own
    (:class:`RankIndices`). ``__call__(hidden_states [T, H], *, tier=None)`` is :func:`layer_forward`;
    ``partials`` is :func:`layer_partials`; ``plan(T)`` is the tail tier a call with T tokens takes, and why;
    ``checkpoint_values()`` the checkpoint's arrays back (:func:`unpack_parameters`: what to save, at any p).
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
        """Every array :func:`layer_forward` takes (global arrays), by name: the Params and the ranks' indices."""
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
    """hidden_states [T, H] on the host, padded with zero rows to token_bucket(T) rows.

    Under jit one program serves every T of a bucket; the caller keeps y's first T rows. Pad where the
    batch is assembled, on the host: any device op on a [T, H] array (a pad, a slice) compiles once per T.
    A zero row routes somewhere harmless and gives a zero row of y.
    """
    num_tokens = hidden_states.shape[0]
    return np.pad(hidden_states, ((0, token_bucket(num_tokens) - num_tokens), (0, 0)))
