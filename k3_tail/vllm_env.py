"""vLLM's environment variables, and k3_tail's K3_TAIL_*, as :class:`~k3_tail.TailConfig` field values (what
``TailConfig.from_env`` applies)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k3_tail.ops.codecs import CODECS
from k3_tail.ops.collectives import SPLIT

OVERLAP_TOKEN_THRESHOLD = "VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD"
DISABLE_OVERLAP = "VLLM_DISABLE_SHARED_EXPERTS_STREAM"
PREFILL_TOKEN_PARALLEL_MIN_TOKENS = "VLLM_KIMI_K3_AMD_PREFILL_SP_MIN_TOKENS"
SHARED_OUTPUT_REDUCED = "VLLM_KIMI_K3_SHARED_OUTPUT_AR_OVERLAP"
QUICK_REDUCE_QUANTIZATION = "VLLM_ROCM_QUICK_REDUCE_QUANTIZATION"
QUICK_REDUCE_MAX_SIZE_MB = "VLLM_ROCM_QUICK_REDUCE_MAX_SIZE_BYTES_MB"
QUICK_REDUCE_CAST_BF16_TO_FP16 = "VLLM_ROCM_QUICK_REDUCE_CAST_BF16_TO_FP16"
# k3_tail's own: vLLM has no one_kernel tier, so no variable for it.
DISABLE_ONE_KERNEL = "K3_TAIL_DISABLE_ONE_KERNEL"

_INTEGERS = ((OVERLAP_TOKEN_THRESHOLD, "overlap_token_threshold"),
             (PREFILL_TOKEN_PARALLEL_MIN_TOKENS, "prefill_token_parallel_min_tokens"))
_BOOLEANS = ((DISABLE_OVERLAP, "disable_overlap"),
             (SHARED_OUTPUT_REDUCED, "shared_output_is_reduced"),
             (QUICK_REDUCE_CAST_BF16_TO_FP16, "quantized_all_reduce_fp16_sizes_for_bf16"))
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off", "")


def config_changes(environ: Mapping[str, str]) -> dict[str, Any]:
    """The TailConfig fields, by name, that the variables set in ``environ`` give (unset ones set nothing): the
    integers ``overlap_token_threshold`` and ``prefill_token_parallel_min_tokens``, the booleans (1/0, true/false,
    yes/no, on/off) ``disable_overlap``, ``shared_output_is_reduced`` and
    ``quantized_all_reduce_fp16_sizes_for_bf16``; VLLM_ROCM_QUICK_REDUCE_QUANTIZATION: INT8/INT6/INT4 the codec,
    NONE off, FP (QuickReduce's unquantised two-shot form) ``all_reduce_form`` "reduce-scatter+all-gather";
    ``quantized_all_reduce_max_bytes`` in MiB; K3_TAIL_DISABLE_ONE_KERNEL true: ``one_kernel_max_tokens`` 0.

    Raises:
      ValueError: naming ``environ`` when it is no mapping, the variable whose name or value is no str, or the
        field and the variable for a value that does not parse.
    """
    check_environ(environ)
    changes: dict[str, Any] = {}
    for variable, field in _INTEGERS:
        if variable in environ:
            changes[field] = _integer(environ[variable], variable, field)
    if QUICK_REDUCE_MAX_SIZE_MB in environ:
        field = "quantized_all_reduce_max_bytes"
        changes[field] = _integer(environ[QUICK_REDUCE_MAX_SIZE_MB], QUICK_REDUCE_MAX_SIZE_MB, field) * 2**20
    if QUICK_REDUCE_QUANTIZATION in environ:
        changes.update(_quick_reduce_regime(environ[QUICK_REDUCE_QUANTIZATION]))
    for variable, field in _BOOLEANS:
        if variable in environ:
            changes[field] = _boolean(environ[variable], variable, field)
    if DISABLE_ONE_KERNEL in environ and _boolean(environ[DISABLE_ONE_KERNEL], DISABLE_ONE_KERNEL,
                                                  "one_kernel_max_tokens"):
        changes["one_kernel_max_tokens"] = 0
    return changes


def check_environ(environ: Any) -> Mapping[str, str]:
    """``environ`` unchanged when it is a Mapping of str to str; ValueError naming it or the variable otherwise."""
    if not isinstance(environ, Mapping):
        raise ValueError(f"environ: expected a mapping of environment variable names to their values (os.environ "
                         f"or a dict of str to str), got {type(environ).__name__}")
    for variable, value in environ.items():
        if not isinstance(variable, str):
            raise ValueError(f"environ: expected variable names that are strings, got {variable!r}")
        if not isinstance(value, str):
            raise ValueError(f"environ[{variable!r}]: expected a string, as every environment variable's value is, "
                             f"got {value!r}")
    return environ


def _integer(raw: str, variable: str, field: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{field}: {variable}={raw!r} is not an integer") from None


def _boolean(raw: str, variable: str, field: str) -> bool:
    word = raw.strip().lower()
    if word not in _TRUE_WORDS + _FALSE_WORDS:
        raise ValueError(f"{field}: {variable}={raw!r} is not a boolean "
                         f"(expected one of {', '.join(w for w in _TRUE_WORDS + _FALSE_WORDS if w)})")
    return word in _TRUE_WORDS


def _quick_reduce_regime(raw: str) -> dict[str, Any]:
    regime = raw.strip().lower()
    if regime == "fp":
        return {"all_reduce_quantization": None, "all_reduce_form": SPLIT}
    if regime == "none":
        return {"all_reduce_quantization": None}
    if regime in CODECS:
        return {"all_reduce_quantization": regime}
    raise ValueError(f"all_reduce_quantization: {QUICK_REDUCE_QUANTIZATION}={raw!r} is not a QuickReduce "
                     f"regime (expected one of FP, {', '.join(name.upper() for name in CODECS)}, NONE)")
