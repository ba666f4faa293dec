"""The Kimi-K3 layer's parameters as a checkpoint holds them: names, global shapes, dtypes, partition specs, and
stand-in values. What the layer holds per rank is :mod:`~k3_tail.models.kimi_k3.packed_parameters`'s.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import PartitionSpec as P

import k3_tail
from k3_tail.models.kimi_k3 import mxfp4, mxfp4_experts as kimi_k3_mxfp4
from k3_tail.models.kimi_k3.layer_config import LayerConfig
from k3_tail.ops.columns import check_weight_layout

# The parameters that hold the routed experts' weights (what k3_tail.models.kimi_k3.schedule traces); with MXFP4
# experts they hold the packed codes, and each has its scales beside it, named here.
ROUTED_EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")
ROUTED_EXPERT_SCALES = {name: f"{name}_scale" for name in ROUTED_EXPERT_WEIGHTS}
# The arrays a decoder stack hands each layer whole, with their leading axis of layers, and the layer's index:
# the routed experts' kernels read them in place (a scan's slice of them would be a copy of the layer's experts).
STACKED_IN_PLACE = (*ROUTED_EXPERT_WEIGHTS, *ROUTED_EXPERT_SCALES.values())
# The stand-in checkpoint's correction bias and norm scale: spread enough that the bias changes some
# top-k choices and the scale is not all ones, as in a trained layer.
ROUTER_BIAS_STDDEV, NORM_SCALE_STDDEV = 0.1, 0.1


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One parameter as a checkpoint holds it: its global shape and dtype, and the normal distribution
    (``mean``, ``stddev``) its stand-in value is drawn from."""

    shape: tuple[int, ...]
    dtype: np.dtype
    stddev: float
    mean: float = 0.0


def layer_parameters(config: LayerConfig) -> dict[str, Parameter]:
    """Every parameter of the layer, by name, in Flax layout (y = x @ W); kernels' stand-ins of variance 1 / fan-in.
    With an FP8 ``config.tail.up_proj_dtype`` the up projection is its FP8 values [L, H] and float32 scales
    ``up_proj_scale`` [H]; with MXFP4 experts each routed kernel [E, K, N] is its codes uint8 [E, K/2, N] and
    ``<name>_scale`` uint8 [E, K/32, N].
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
    """How the TP ranks hold each parameter, by name; an MXFP4 scale as its kernel. ValueError unless p divides
    m, F, and H for the column layout, and with MXFP4 experts unless 32 p divides m (whole groups per rank).
    """
    splits = {"expert_intermediate_size": config.expert_intermediate_size,
              "shared_intermediate_size": config.shared_intermediate_size}
    if check_weight_layout(weight_layout) == "column":
        splits["hidden_size"] = config.hidden_size
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


def random_checkpoint(config: LayerConfig, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Stand-in weights for a checkpoint, by name, each in its dtype; an FP8 up projection drawn in the layer's
    dtype and quantised, as a server does at load. Drawn on the host with numpy: ``jax.random`` would compile
    per shape."""
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
