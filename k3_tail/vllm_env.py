"""vLLM's environment variables as :class:`~k3_tail.TailConfig` fields (what ``TailConfig.from_env`` applies),
and one of k3_tail's own, named K3_TAIL_*, for a switch vLLM has no variable for.

Below the config: it returns field values, and the config applies them.
"""

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
    """The TailConfig fields that the vLLM variables (and k3_tail's) set in ``environ`` give, by field name.

    VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD sets ``overlap_token_threshold`` and
    VLLM_KIMI_K3_AMD_PREFILL_SP_MIN_TOKENS ``prefill_token_parallel_min_tokens`` (integers; the config
    checks their range); VLLM_DISABLE_SHARED_EXPERTS_STREAM sets ``disable_overlap``,
    VLLM_KIMI_K3_SHARED_OUTPUT_AR_OVERLAP ``shared_output_is_reduced`` and
    VLLM_ROCM_QUICK_REDUCE_CAST_BF16_TO_FP16 ``quantized_all_reduce_fp16_sizes_for_bf16`` (each 1/0,
    true/false, yes/no, on/off). VLLM_ROCM_QUICK_REDUCE_QUANTIZATION (case-insensitive) sets
    ``all_reduce_quantization``: INT8, INT6, INT4 the codec; NONE off; FP, QuickReduce's unquantised
    two-shot form, sets ``all_reduce_form`` to "reduce-scatter+all-gather" (for every sum: both forms are
    exact, so no size window is needed). VLLM_ROCM_QUICK_REDUCE_MAX_SIZE_BYTES_MB sets
    ``quantized_all_reduce_max_bytes`` (an integer, in MiB). K3_TAIL_DISABLE_ONE_KERNEL (a boolean as
    above) true sets ``one_kernel_max_tokens`` to 0, so that vLLM's rules, the default policy, never pick
    the one_kernel tier; false sets nothing (the base's limit stays). Unset variables set nothing.

    Raises:
      ValueError: naming ``environ`` when it is no mapping of variable names to values (``os.environ``, a
        dict), naming the variable when one of its names or values is not a str (as every environment's
        are: an int or None would be read as no value, or fail as no string), and naming the field and the
        variable for a value that does not parse.
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
    """``environ`` unchanged when it is a Mapping of str to str, as an environment is; ValueError naming
    ``environ``, or the variable whose name or value is not a str, otherwise."""
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
    """The config fields that QuickReduce's quantisation regime ``raw`` (its environment value) sets."""
    regime = raw.strip().lower()
    if regime == "fp":
        return {"all_reduce_quantization": None, "all_reduce_form": SPLIT}
    if regime == "none":
        return {"all_reduce_quantization": None}
    if regime in CODECS:
        return {"all_reduce_quantization": regime}
    raise ValueError(f"all_reduce_quantization: {QUICK_REDUCE_QUANTIZATION}={raw!r} is not a QuickReduce "
                     f"regime (expected one of FP, {', '.join(name.upper() for name in CODECS)}, NONE)")
