"""The tail's configuration: model shapes, numerics and the switches that steer tier selection."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
import numpy as np

from k3_tail._checks import check_int
from k3_tail.hf_config import tail_fields, text_config
from k3_tail.ops.codecs import CODECS
from k3_tail.ops.collectives import ALL_REDUCE_FORMS, QUICK_REDUCE_MIN_MIB, SumPlan
from k3_tail.ops.norm import norm_is_computable
from k3_tail.ops.up_projection import FP8_FORMATS, fp8_format
from k3_tail.policy import SelectionPolicy
from k3_tail.vllm_env import config_changes

_FLOAT_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_FLOAT32_TINY, _FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)

ALL_REDUCE_QUANTIZATIONS = (None, *CODECS)
# QuickReduce's largest buffer when VLLM_ROCM_QUICK_REDUCE_MAX_SIZE_BYTES_MB is unset: 2 GiB.
DEFAULT_QUANTIZED_ALL_REDUCE_MAX_BYTES = 2**31


@dataclasses.dataclass(frozen=True)
class TailConfig:
    """Static description of one latent MoE tail (hashable: it is a static argument under jit).

    Shapes: the routed experts finish in ``latent_size`` (L) columns, the layer's output has
    ``hidden_size`` (H) columns; the up projection maps L -> H.

    Numerics: ``y = RMSNorm_g(routed_scaling_factor * sum_i r_i) @ W + sum_i s_i``, the norm in
    float32 with ``rms_norm_eps``, skipped when ``use_latent_norm`` is False. Activations and
    weights are ``dtype``; GEMMs and the norm accumulate in float32; collectives move ``dtype``.
    ``rms_norm_eps`` (> 0) and ``routed_scaling_factor`` (any sign, or 0) are Python or numpy real
    numbers that float32 holds as normal numbers (magnitudes 1.2e-38 to 3.4e38), stored as floats.

    Up-projection weights (:mod:`k3_tail.ops.up_projection`):
      up_proj_dtype: None (or ``dtype`` itself): the kernel W is an array of ``dtype``.
        "float8_e4m3fn" or "float8_e4m3fnuz" (names or jnp dtypes): W is a
        :class:`k3_tail.QuantizedKernel` of that format with per-column float32 scales
        (:func:`k3_tail.quantize_up_proj`), half the bytes of bf16; the GEMM reads the FP8 values.
      fp8_activations: with an FP8 ``up_proj_dtype`` only. False (default): weight-only FP8, the
        GEMM runs in ``dtype``. True: the normalised latent is also quantised per token to the same
        format and the GEMM multiplies two FP8 operands, accumulating in float32 (for large T on
        hardware with FP8 matrix units).

    Selection switches (see :func:`k3_tail.select_tier`):
      overlap_token_threshold: largest token count served by the overlap tier (vLLM: 256).
      disable_overlap: never pick the overlap tier (vLLM_DISABLE_SHARED_EXPERTS_STREAM).
      one_kernel_max_tokens: on a GPU (CUDA or ROCm), pick the one_kernel tier for 0 < T <= this many
        tokens (decode; 0: never, which K3_TAIL_DISABLE_ONE_KERNEL=1 sets through ``from_env``), where one
        GPU kernel per call beats the XLA tiers' 3-8 (the default, 16: as far as the kernel's split of K
        gives it the 1024 programs a GPU wants, for p = 2 to 16, and the cost model predicts it fastest at
        least that far on every preset: docs/guide.md).
      use_scatter_gather / scatter_gather_max_tokens: pick the scatter-gather tier for
        0 < T <= max tokens, as vLLM does with its fused tier-0 op (off by default: vLLM enables it
        only on SM100 GPUs).
      has_shared_experts: the layer has shared experts, so a shared partial exists.
      routed_output_is_reduced: the routed output arrives already reduced (expert parallelism
        reduces it in the combine); the tail then skips the latent all-reduce and takes one
        replicated [T, L] latent instead of per-rank partials. ``fused_output_is_reduced`` (vLLM's
        name) is accepted for it with a DeprecationWarning.
      shared_output_is_reduced: the shared-expert output arrives already reduced
        (:func:`k3_tail.reduce_shared`, called as soon as the shared experts finish so that its
        collective runs during the routed experts: vLLM's VLLM_KIMI_K3_SHARED_OUTPUT_AR_OVERLAP);
        the tail then puts no collective on it and takes it in place of the shared partials, in
        the form :func:`k3_tail.reduce_shared` returns. Needs ``has_shared_experts``. Each tier's
        record says how its schedule changes (``Tier.X.record.prose.shared_reduced_form``).
      sequence_parallel: the surrounding model shards tokens over the TP axis: every tier returns
        y token-sharded ([T/p, H] per rank; see :mod:`k3_tail.ops.tokens`).
      prefill_token_parallel_min_tokens: with sequence-parallel output, pick the token_parallel
        tier from this many tokens on (vLLM's VLLM_KIMI_K3_AMD_PREFILL_SP_MIN_TOKENS); 0: never.
      all_reduce_form: how a sum over the ranks travels: "auto" (one all-reduce, or a reduce-scatter
        + all-gather where that was measured faster: :mod:`k3_tail.ops.collectives`),
        "all-reduce" or "reduce-scatter+all-gather".

    Quantised sums (vLLM ROCm's QuickReduce, :mod:`k3_tail.ops.collectives`):
      all_reduce_quantization: None (default: sums travel in ``dtype``) or "int8", "int6", "int4":
        every sum the tail sends over the TP axis whose buffer holds between the two sizes below
        travels block-quantised (:mod:`k3_tail.ops.codecs`) as a two-shot all-reduce (all-to-all of
        each rank's chunks, float32 sum by the chunk's owner, re-quantised all-gather); a sum that
        only scatters sends the first shot alone. It changes the result (each value by at most about
        one codec step of its 32-value block per shot), so no selection policy turns it on; the
        selection reason says which of the tier's sums it quantises.
      quantized_all_reduce_min_bytes: the smallest buffer (bytes, in ``dtype``) that is quantised;
        None (default): vLLM's minimum-size table for the codec, ``dtype`` and p
        (:meth:`TailConfig.quantization_min_bytes`).
      quantized_all_reduce_max_bytes: the largest buffer that is quantised (default 2 GiB, as
        QuickReduce's).
      quantized_all_reduce_fp16_sizes_for_bf16: with the default minimum, bfloat16 buffers follow
        vLLM's float16 table (True, default: what vLLM's default bf16-to-fp16 cast does) or its far
        larger bfloat16 one (False). The codec itself computes in float32 either way.
      selection_policy: how the tier is chosen for a token count (a
        :class:`k3_tail.policy.SelectionPolicy`). None (default) or ``selection.rules.VllmRules()``:
        the rules above (vLLM's fixed thresholds). A :class:`k3_tail.SelectionTable`: the table
        measured on this hardware (:mod:`k3_tail.selection.table`). ``cost_model.CostModelPolicy("mi355x")``:
        the tier :mod:`k3_tail.selection.cost_model` predicts fastest on that hardware preset.
    """

    hidden_size: int
    latent_size: int
    rms_norm_eps: float = 1e-6
    routed_scaling_factor: float = 1.0
    use_latent_norm: bool = True
    dtype: Any = jnp.bfloat16
    up_proj_dtype: Any = None
    fp8_activations: bool = False
    overlap_token_threshold: int = 256
    disable_overlap: bool = False
    one_kernel_max_tokens: int = 16
    use_scatter_gather: bool = False
    scatter_gather_max_tokens: int = 128
    has_shared_experts: bool = True
    routed_output_is_reduced: bool = False
    shared_output_is_reduced: bool = False
    sequence_parallel: bool = False
    prefill_token_parallel_min_tokens: int = 0
    all_reduce_form: str = "auto"
    all_reduce_quantization: str | None = None
    quantized_all_reduce_min_bytes: int | None = None
    quantized_all_reduce_max_bytes: int = DEFAULT_QUANTIZED_ALL_REDUCE_MAX_BYTES
    quantized_all_reduce_fp16_sizes_for_bf16: bool = True
    selection_policy: SelectionPolicy | None = None

    def __post_init__(self):
        for name, minimum in (("hidden_size", 1), ("latent_size", 1),
                              ("overlap_token_threshold", 0), ("one_kernel_max_tokens", 0),
                              ("scatter_gather_max_tokens", 0),
                              ("prefill_token_parallel_min_tokens", 0)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=minimum))
        # The norm computes in float32, which flushes subnormal numbers to zero: an eps there would let an
        # all-zero row (a padding token's) normalise to NaN, and a subnormal scale is zero.
        object.__setattr__(self, "rms_norm_eps", _float32_normal("rms_norm_eps", self.rms_norm_eps, zero=False))
        object.__setattr__(self, "routed_scaling_factor",
                           _float32_normal("routed_scaling_factor", self.routed_scaling_factor, zero=True))
        if self.routed_scaling_factor != 0 and not norm_is_computable(self.rms_norm_eps, self.routed_scaling_factor,
                                                                      self.latent_size):
            raise ValueError(
                f"routed_scaling_factor: with rms_norm_eps={self.rms_norm_eps!r} and latent_size={self.latent_size}, "
                f"expected eps / routed_scaling_factor^2 between 2^-252 and about 2^228 / L, where the norm can "
                f"be computed in float32 (k3_tail.ops.norm.norm_is_computable), got "
                f"{self.rms_norm_eps / self.routed_scaling_factor**2:.3g}"
            )
        for name in ("use_latent_norm", "fp8_activations", "disable_overlap", "use_scatter_gather",
                     "has_shared_experts", "routed_output_is_reduced", "shared_output_is_reduced",
                     "sequence_parallel", "quantized_all_reduce_fp16_sizes_for_bf16"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.shared_output_is_reduced and not self.has_shared_experts:
            raise ValueError("shared_output_is_reduced: a reduced shared output needs shared experts, but "
                             "has_shared_experts is False")
        if self.all_reduce_form not in ALL_REDUCE_FORMS:
            raise ValueError(f"all_reduce_form: expected one of {ALL_REDUCE_FORMS}, got {self.all_reduce_form!r}")
        self._check_quantization()
        dtype = _float_dtype(self.dtype)
        if dtype is None:
            names = ", ".join(d.name for d in _FLOAT_DTYPES)
            raise ValueError(f"dtype: expected one of {names}, got {self.dtype!r}")
        # Normalised so that equal configs hash equally whatever spelling of the dtype was given.
        object.__setattr__(self, "dtype", dtype)
        up_proj_dtype = self.up_proj_dtype
        if up_proj_dtype is None or _float_dtype(up_proj_dtype) == dtype:
            up_proj_dtype = None  # the kernel in the activations' dtype is the unquantised kernel
        else:
            up_proj_dtype = fp8_format(up_proj_dtype, "up_proj_dtype")
        object.__setattr__(self, "up_proj_dtype", up_proj_dtype)
        if self.fp8_activations and up_proj_dtype is None:
            raise ValueError(f"fp8_activations: needs an FP8 up_proj_dtype (one of {FP8_FORMATS}), got None")
        if self.selection_policy is not None and not isinstance(self.selection_policy, SelectionPolicy):
            raise ValueError(
                "selection_policy: expected None (vLLM's rules) or a k3_tail.policy.SelectionPolicy "
                "(selection.rules.VllmRules(), a k3_tail.SelectionTable, selection.cost_model.CostModelPolicy(name)), "
                f"got {self.selection_policy!r}"
            )

    def _check_quantization(self) -> None:
        if self.all_reduce_quantization not in ALL_REDUCE_QUANTIZATIONS:
            raise ValueError(f"all_reduce_quantization: expected one of {ALL_REDUCE_QUANTIZATIONS}, "
                             f"got {self.all_reduce_quantization!r}")
        maximum = check_int("quantized_all_reduce_max_bytes", self.quantized_all_reduce_max_bytes, minimum=1)
        object.__setattr__(self, "quantized_all_reduce_max_bytes", maximum)
        if self.quantized_all_reduce_min_bytes is not None:
            minimum = check_int("quantized_all_reduce_min_bytes", self.quantized_all_reduce_min_bytes, minimum=0)
            object.__setattr__(self, "quantized_all_reduce_min_bytes", minimum)
            if minimum > maximum:
                raise ValueError(f"quantized_all_reduce_min_bytes: expected at most quantized_all_reduce_max_bytes="
                                 f"{maximum}, got {minimum}")

    @classmethod
    def kimi_k3(cls, **overrides: Any) -> TailConfig:
        """Kimi-K3's tail: H = 7168, L = 3584, eps 1e-5 (its released config.json), scale 1.0, bf16.

        The generic default of ``rms_norm_eps`` (a plain ``TailConfig(...)``) stays 1e-6, vLLM's
        RMSNorm default; this preset and :meth:`from_hf_config` set the model's own value.
        """
        return cls(**{"hidden_size": 7168, "latent_size": 3584, "rms_norm_eps": 1e-5, **overrides})

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> TailConfig:
        """The tail of a Hugging Face model's config: ``config`` a path to its config.json, a checkpoint
        directory holding one, a ``.safetensors`` file (the config.json beside it: every path
        :func:`k3_tail.load_tail_weights` takes), or the config as a dict (its ``text_config`` read when
        nested).

        Sets hidden_size, latent_size (``routed_expert_hidden_size``), rms_norm_eps,
        routed_scaling_factor, use_latent_norm (``latent_moe_use_norm``) and dtype (``torch_dtype``);
        ``overrides`` set any field as keywords (``up_proj_dtype=...``, ``all_reduce_quantization=...``).
        ValueError naming the config's field (``text_config.rms_norm_eps``) when it has no
        ``routed_expert_hidden_size`` (no latent MoE), misses a field or holds a value the tail cannot
        serve (:mod:`k3_tail.hf_config`); naming the file when it cannot be read.
        """
        text = text_config(config)
        fields = tail_fields(text)
        # The two numbers the tail holds to float32's normal range, checked here under the file's names.
        for name, zero in (("rms_norm_eps", False), ("routed_scaling_factor", True)):
            if name not in overrides:
                _float32_normal(text.name(name), fields[name], zero=zero)
        return cls(**{**fields, **overrides})

    def quantization_min_bytes(self, tp_size: int) -> int | None:
        """The smallest buffer (bytes) sent quantised over ``tp_size`` ranks, or None when nothing is: no
        codec, p = 1, or a dtype without a vLLM table (float32) and no ``quantized_all_reduce_min_bytes``."""
        if self.all_reduce_quantization is None or tp_size == 1:
            return None
        if self.quantized_all_reduce_min_bytes is not None:
            return self.quantized_all_reduce_min_bytes
        dtype = self.dtype.name
        if dtype == "bfloat16" and self.quantized_all_reduce_fp16_sizes_for_bf16:
            dtype = "float16"
        rows = [size for (name, size) in QUICK_REDUCE_MIN_MIB if name == dtype and size <= tp_size]
        if not rows:
            return None
        return QUICK_REDUCE_MIN_MIB[dtype, max(rows)][self.all_reduce_quantization] * 2**20

    def sum_plan(self, tp_size: int, platform: str | None = None) -> SumPlan:
        """How this config's sums travel over ``tp_size`` ranks of ``platform`` (as
        :func:`k3_tail.hardware.device_platform` names a device's; None: not known): the all-reduce form, and
        the codec with the buffer sizes it quantises (an empty buffer never is: nothing travels)."""
        minimum = self.quantization_min_bytes(tp_size)
        if minimum is None:
            return SumPlan(self.all_reduce_form, platform)
        return SumPlan(self.all_reduce_form, platform, CODECS[self.all_reduce_quantization],
                       (max(minimum, 1), self.quantized_all_reduce_max_bytes))

    @classmethod
    def from_env(cls, base: TailConfig | None = None, environ: Mapping[str, str] | None = None) -> TailConfig:
        """``base`` (default: Kimi-K3) with vLLM's variables, and k3_tail's K3_TAIL_DISABLE_ONE_KERNEL, in
        ``environ`` (default: ``os.environ``) applied (:func:`k3_tail.vllm_env.config_changes` says which set
        what); ValueError naming the field for a value that does not parse or that the field does not take,
        naming ``environ`` (or the variable) when it is no mapping of str to str, and naming ``base`` when it is
        no TailConfig."""
        if base is not None and not isinstance(base, TailConfig):
            raise ValueError(f"base: expected a k3_tail.TailConfig or None (Kimi-K3's), got {type(base).__name__}")
        base = cls.kimi_k3() if base is None else base
        return dataclasses.replace(base, **config_changes(os.environ if environ is None else environ))


_DEPRECATED_FIELDS = MappingProxyType({"fused_output_is_reduced": "routed_output_is_reduced"})
_dataclass_init = TailConfig.__init__


@functools.wraps(_dataclass_init)
def _init_accepting_deprecated_names(self, *args: Any, **fields: Any) -> None:
    for old, new in _DEPRECATED_FIELDS.items():
        if old in fields:
            warnings.warn(f"TailConfig({old}=...) is deprecated: use {new}", DeprecationWarning, stacklevel=2)
            if new in fields:
                raise ValueError(f"{old}: the deprecated name of {new}, which is given too: give only {new}")
            fields[new] = fields.pop(old)
    _dataclass_init(self, *args, **fields)


def _deprecated_field(old: str, new: str) -> property:
    def read(self: TailConfig) -> Any:
        warnings.warn(f"TailConfig.{old} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(read, doc=f"Deprecated: :attr:`{new}`.")


TailConfig.__init__ = _init_accepting_deprecated_names
for _old, _new in _DEPRECATED_FIELDS.items():
    setattr(TailConfig, _old, _deprecated_field(_old, _new))


def _float32_normal(name: str, value: Any, *, zero: bool) -> float:
    """``value`` (a Python or numpy real number) as a Python float that float32 holds as a normal number,
    with either sign and 0 allowed when ``zero``, else > 0; ValueError naming ``name`` otherwise."""
    expected = "a finite number" if zero else "a finite number > 0"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}: expected {expected} (a Python or numpy real number), got {value!r}")
    number = float(value)
    if not math.isfinite(number) or (not zero and number <= 0):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    if number != 0 and not _FLOAT32_TINY <= abs(number) <= _FLOAT32_MAX:
        raise ValueError(f"{name}: expected {expected} {'of a magnitude ' if zero else ''}that float32 holds as a "
                         f"normal number ({_FLOAT32_TINY:.8g} to {_FLOAT32_MAX:.8g}: the norm computes in float32, "
                         f"which flushes smaller numbers to zero and holds no larger one), got {value!r}")
    return number


def check_config(config: Any) -> TailConfig:
    """``config`` unchanged, or ValueError when it is not a :class:`TailConfig`."""
    if not isinstance(config, TailConfig):
        raise ValueError(f"config: expected a k3_tail.TailConfig, got {type(config).__name__}")
    return config


def _float_dtype(value: Any) -> np.dtype | None:
    """``value`` as one of the supported float dtypes, or None when it names none of them."""
    if value is None:  # np.dtype(None) would be float64
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        return None
    return dtype if dtype in _FLOAT_DTYPES else None
