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
    """Static description of one latent MoE tail (hashable: a static argument under jit); ValueError naming the
    field for a value it does not take.

    Shapes and numerics: ``y = RMSNorm_g(routed_scaling_factor * sum_i r_i) @ W + sum_i s_i``, W mapping
    ``latent_size`` (L) to ``hidden_size`` (H) columns; the norm in float32 with ``rms_norm_eps``, skipped
    without ``use_latent_norm``. Activations, weights and collectives are ``dtype``; GEMMs and the norm
    accumulate in float32. ``rms_norm_eps`` (> 0) and ``routed_scaling_factor`` (any sign, or 0) are real
    numbers that float32 holds as normal numbers, stored as floats.

    Up-projection weights (:mod:`k3_tail.ops.up_projection`):
      up_proj_dtype: None (or ``dtype``): W is an array of ``dtype``; "float8_e4m3fn" or "float8_e4m3fnuz":
        a :class:`k3_tail.QuantizedKernel` of that format (:func:`k3_tail.quantize_up_proj`).
      fp8_activations: with an FP8 ``up_proj_dtype`` only: the latent is quantised per token too and the GEMM
        multiplies two FP8 operands (False: weight-only FP8, the GEMM in ``dtype``).

    Selection switches (:func:`k3_tail.select_tier`; docs/design.md, "Selection"):
      overlap_token_threshold, disable_overlap: the overlap tier up to this T (vLLM: 256), or never.
      one_kernel_max_tokens: the one_kernel tier on a GPU for 0 < T <= this (0: never;
        K3_TAIL_DISABLE_ONE_KERNEL=1 sets it through ``from_env``).
      use_scatter_gather, scatter_gather_max_tokens: the scatter-gather tier for 0 < T <= max (off by default).
      has_shared_experts: the layer has shared experts, so a shared partial exists.
      routed_output_is_reduced: the routed output arrives reduced (expert parallelism's combine): one replicated
        [T, L] latent, no latent all-reduce. ``fused_output_is_reduced``, vLLM's name, is deprecated.
      shared_output_is_reduced: the shared output arrives reduced, in the form :func:`k3_tail.reduce_shared`
        returns (issued as the shared experts finish); needs ``has_shared_experts``.
      sequence_parallel: every tier returns y token-sharded ([T/p, H] per rank: :mod:`k3_tail.ops.tokens`).
      prefill_token_parallel_min_tokens: with sequence-parallel output, the token_parallel tier from this T
        on (0: never).
      all_reduce_form: "auto", "all-reduce" or "reduce-scatter+all-gather" (:mod:`k3_tail.ops.collectives`).
      selection_policy: a :class:`k3_tail.policy.SelectionPolicy`: None or ``VllmRules()`` (vLLM's rules), a
        :class:`k3_tail.SelectionTable`, or ``CostModelPolicy("mi355x")``.

    Quantised sums (vLLM ROCm's QuickReduce, :mod:`k3_tail.ops.collectives`):
      all_reduce_quantization: None (default) or "int8", "int6", "int4": every sum whose buffer lies between
        the two sizes below travels block-quantised. It changes the result, so no selection policy turns it on.
      quantized_all_reduce_min_bytes: the smallest buffer quantised; None: vLLM's table
        (:meth:`quantization_min_bytes`).
      quantized_all_reduce_max_bytes: the largest (default 2 GiB, as QuickReduce's).
      quantized_all_reduce_fp16_sizes_for_bf16: with the default minimum, bfloat16 buffers follow vLLM's
        float16 table (True, vLLM's default) or its far larger bfloat16 one.
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
        """Kimi-K3's tail: H = 7168, L = 3584, eps 1e-5 (its released config.json), scale 1.0, bf16; the plain
        default eps stays vLLM's 1e-6."""
        return cls(**{"hidden_size": 7168, "latent_size": 3584, "rms_norm_eps": 1e-5, **overrides})

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> TailConfig:
        """The tail of a Hugging Face model's ``config`` (a config.json, a directory or ``.safetensors`` file
        beside one, or the dict; a nested ``text_config`` read), ``overrides`` setting any field.

        Raises:
          ValueError: naming the config's field (``text_config.rms_norm_eps``) when it is missing (no
            ``routed_expert_hidden_size``: no latent MoE) or the tail cannot serve it; naming an unreadable file.
        """
        text = text_config(config)
        fields = tail_fields(text)
        # The two numbers the tail holds to float32's normal range, checked here under the file's names.
        for name, zero in (("rms_norm_eps", False), ("routed_scaling_factor", True)):
            if name not in overrides:
                _float32_normal(text.name(name), fields[name], zero=zero)
        return cls(**{**fields, **overrides})

    def quantization_min_bytes(self, tp_size: int) -> int | None:
        """The smallest buffer (bytes) sent quantised over ``tp_size`` ranks, or None when nothing is (no codec,
        p = 1, or no vLLM table for the dtype and no ``quantized_all_reduce_min_bytes``)."""
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
        """How this config's sums travel over ``tp_size`` ranks of ``platform`` (None: not known)."""
        minimum = self.quantization_min_bytes(tp_size)
        if minimum is None:
            return SumPlan(self.all_reduce_form, platform)
        return SumPlan(self.all_reduce_form, platform, CODECS[self.all_reduce_quantization],
                       (max(minimum, 1), self.quantized_all_reduce_max_bytes))

    @classmethod
    def from_env(cls, base: TailConfig | None = None, environ: Mapping[str, str] | None = None) -> TailConfig:
        """``base`` (default: Kimi-K3) with vLLM's variables and K3_TAIL_DISABLE_ONE_KERNEL in ``environ`` (default:
        ``os.environ``) applied (:mod:`k3_tail.vllm_env`). ValueError naming the field, the variable, ``environ``
        or ``base`` for what it cannot take."""
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
    """``value`` (a real number) as a float that float32 holds as a normal number (> 0 unless ``zero``, which
    allows 0 and either sign); ValueError naming ``name`` otherwise."""
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
    if value is None:  # np.dtype(None) would be float64
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        return None
    return dtype if dtype in _FLOAT_DTYPES else None
