"""TailConfig: defaults, the Kimi-K3 preset, vLLM's environment variables (and k3_tail's own), and rejected
values."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from k3_tail import TailConfig, Tier, select_tier


def test_defaults_follow_the_spec():
    config = TailConfig(hidden_size=64, latent_size=32)
    assert config.rms_norm_eps == 1e-6
    assert config.routed_scaling_factor == 1.0
    assert config.use_latent_norm is True
    assert config.dtype == np.dtype(jnp.bfloat16)
    assert config.overlap_token_threshold == 256
    assert config.disable_overlap is False
    assert config.has_shared_experts is True
    assert config.routed_output_is_reduced is False
    assert config.sequence_parallel is False


def test_kimi_k3_shapes_and_overrides():
    assert (TailConfig.kimi_k3().hidden_size, TailConfig.kimi_k3().latent_size) == (7168, 3584)
    assert TailConfig.kimi_k3().rms_norm_eps == 1e-5  # the released config.json's
    assert TailConfig.kimi_k3(rms_norm_eps=1e-6).rms_norm_eps == 1e-6


def test_equal_configs_hash_equally_whatever_the_dtype_spelling():
    """Configs are static jit arguments: "bfloat16", jnp.bfloat16 and np.dtype must be one key."""
    spellings = [TailConfig(8, 4, dtype=d) for d in ("bfloat16", jnp.bfloat16, np.dtype(jnp.bfloat16))]
    assert len(set(spellings)) == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("hidden_size", 0),
        ("hidden_size", -7168),
        ("latent_size", 2.5),
        ("latent_size", True),
        ("rms_norm_eps", 0.0),
        ("rms_norm_eps", -1e-6),
        ("rms_norm_eps", float("nan")),
        ("rms_norm_eps", 1e-40),  # float32 flushes it to zero
        ("rms_norm_eps", 1e39),  # beyond float32
        ("rms_norm_eps", "1e-5"),
        ("routed_scaling_factor", float("inf")),
        ("routed_scaling_factor", 1e-40),
        ("routed_scaling_factor", np.bool_(True)),
        ("overlap_token_threshold", -1),
        ("scatter_gather_max_tokens", -1),
        ("dtype", jnp.int32),
        ("dtype", "not-a-dtype"),
        ("dtype", None),
        ("dtype", "float64"),
        ("use_latent_norm", 1),
        ("sequence_parallel", "yes"),
        ("all_reduce_quantization", "int5"),
        ("all_reduce_quantization", "INT4"),
        ("quantized_all_reduce_min_bytes", -1),
        ("quantized_all_reduce_min_bytes", 3 * 2**31),  # above the maximum
        ("quantized_all_reduce_max_bytes", 0),
        ("quantized_all_reduce_fp16_sizes_for_bf16", "no"),
    ],
)
def test_invalid_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        dataclasses.replace(TailConfig.kimi_k3(), **{field: value})


def test_an_eps_below_float32s_smallest_normal_is_refused_saying_why():
    with pytest.raises(ValueError, match=r"^rms_norm_eps: .*normal number .*flushes smaller numbers to zero"):
        TailConfig(8, 4, rms_norm_eps=1e-40)


@pytest.mark.parametrize("number", [np.float32(1e-5), np.float64(1e-5), np.float16(0.001), np.int64(2)],
                         ids=lambda number: type(number).__name__)
def test_numpy_real_scalars_are_taken_wherever_python_numbers_are(number):
    config = TailConfig(8, 4, rms_norm_eps=number, routed_scaling_factor=number)
    assert config.rms_norm_eps == float(number) and type(config.rms_norm_eps) is float
    assert config.routed_scaling_factor == float(number) and type(config.routed_scaling_factor) is float
    assert config == TailConfig(8, 4, rms_norm_eps=float(number), routed_scaling_factor=float(number))


def test_from_env_honours_vllm_variables():
    environ = {"VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": " 64 ", "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1"}
    config = TailConfig.from_env(environ=environ)
    assert (config.overlap_token_threshold, config.disable_overlap) == (64, True)
    assert (config.hidden_size, config.latent_size) == (7168, 3584)


@pytest.mark.parametrize("word, disabled", [("0", False), ("false", False), ("TRUE", True), ("on", True), ("", False)])
def test_from_env_reads_boolean_words(word, disabled):
    config = TailConfig.from_env(environ={"VLLM_DISABLE_SHARED_EXPERTS_STREAM": word})
    assert config.disable_overlap is disabled


def test_from_env_without_variables_keeps_the_base():
    base = TailConfig(hidden_size=96, latent_size=64, overlap_token_threshold=7)
    assert TailConfig.from_env(base, environ={}) == base


@pytest.mark.parametrize(
    "variable, value, field",
    [
        ("VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD", "lots", "overlap_token_threshold"),
        ("VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD", "2.5", "overlap_token_threshold"),
        ("VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD", "-3", "overlap_token_threshold"),
        ("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "maybe", "disable_overlap"),
        ("VLLM_KIMI_K3_SHARED_OUTPUT_AR_OVERLAP", "2", "shared_output_is_reduced"),
        ("VLLM_ROCM_QUICK_REDUCE_QUANTIZATION", "INT3", "all_reduce_quantization"),
        ("VLLM_ROCM_QUICK_REDUCE_MAX_SIZE_BYTES_MB", "big", "quantized_all_reduce_max_bytes"),
        ("VLLM_ROCM_QUICK_REDUCE_MAX_SIZE_BYTES_MB", "0", "quantized_all_reduce_max_bytes"),
        ("VLLM_ROCM_QUICK_REDUCE_CAST_BF16_TO_FP16", "fp16", "quantized_all_reduce_fp16_sizes_for_bf16"),
        ("K3_TAIL_DISABLE_ONE_KERNEL", "maybe", "one_kernel_max_tokens"),
    ],
)
def test_from_env_rejects_unparsable_values(variable, value, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        TailConfig.from_env(environ={variable: value})


@pytest.mark.parametrize(("environ", "message"), [
    (["VLLM_DISABLE_SHARED_EXPERTS_STREAM=1"], r"^environ: expected a mapping .*, got list"),
    ({"VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": 256},
     r"^environ\['VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD'\]: expected a string, .* got 256"),
    ({"VLLM_DISABLE_SHARED_EXPERTS_STREAM": None},
     r"^environ\['VLLM_DISABLE_SHARED_EXPERTS_STREAM'\]: expected a string"),
    ({1: "1"}, r"^environ: expected variable names that are strings, got 1"),
], ids=["list", "int-value", "none-value", "int-name"])
def test_from_env_takes_only_a_mapping_of_strings_to_strings(environ, message):
    with pytest.raises(ValueError, match=message):
        TailConfig.from_env(environ=environ)


def test_from_env_refuses_a_base_that_is_no_config():
    with pytest.raises(ValueError, match="^base: expected a k3_tail.TailConfig or None"):
        TailConfig.from_env({"hidden_size": 16}, environ={})


@pytest.mark.parametrize("word", ["1", "true", "ON"])
def test_from_env_turns_the_one_kernel_tier_off_with_k3_tails_switch(word):
    config = TailConfig.from_env(environ={"K3_TAIL_DISABLE_ONE_KERNEL": word})
    assert config.one_kernel_max_tokens == 0
    assert select_tier(config, 1, 8, weight_layout="column", platform="rocm").tier is not Tier.ONE_KERNEL


@pytest.mark.parametrize("word", ["0", "false", ""])
def test_from_env_keeps_the_bases_one_kernel_limit_where_the_switch_is_false(word):
    base = TailConfig(hidden_size=96, latent_size=64, one_kernel_max_tokens=7)
    assert TailConfig.from_env(base, environ={"K3_TAIL_DISABLE_ONE_KERNEL": word}) == base


def test_from_env_reads_the_prefill_token_parallel_threshold():
    config = TailConfig.from_env(environ={"VLLM_KIMI_K3_AMD_PREFILL_SP_MIN_TOKENS": "2048"})
    assert config.prefill_token_parallel_min_tokens == 2048
    assert TailConfig.from_env(environ={}).prefill_token_parallel_min_tokens == 0


@pytest.mark.parametrize(("field", "value"), [("prefill_token_parallel_min_tokens", -1),
                                              ("all_reduce_form", "ring")])
def test_new_fields_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        dataclasses.replace(TailConfig.kimi_k3(), **{field: value})


def test_from_env_rejects_an_unparsable_prefill_threshold():
    with pytest.raises(ValueError, match="^prefill_token_parallel_min_tokens: VLLM_KIMI_K3_AMD_PREFILL_SP_MIN_TOKENS"):
        TailConfig.from_env(environ={"VLLM_KIMI_K3_AMD_PREFILL_SP_MIN_TOKENS": "many"})


@pytest.mark.parametrize(("word", "reduced"), [("1", True), ("off", False)])
def test_from_env_reads_the_early_shared_reduction_switch(word, reduced):
    config = TailConfig.from_env(environ={"VLLM_KIMI_K3_SHARED_OUTPUT_AR_OVERLAP": word})
    assert config.shared_output_is_reduced is reduced
    assert TailConfig.from_env(environ={}).shared_output_is_reduced is False


def test_a_reduced_shared_output_without_shared_experts_names_both():
    with pytest.raises(ValueError, match=r"^shared_output_is_reduced: .*has_shared_experts is False"):
        TailConfig.kimi_k3(shared_output_is_reduced=True, has_shared_experts=False)


@pytest.mark.parametrize(("regime", "quantization", "form"), [
    ("INT8", "int8", "auto"), ("INT6", "int6", "auto"), ("int4", "int4", "auto"), ("NONE", None, "auto"),
    ("FP", None, "reduce-scatter+all-gather"),  # QuickReduce's unquantised two-shot form
])
def test_from_env_reads_the_quick_reduce_regime(regime, quantization, form):
    config = TailConfig.from_env(environ={"VLLM_ROCM_QUICK_REDUCE_QUANTIZATION": regime})
    assert (config.all_reduce_quantization, config.all_reduce_form) == (quantization, form)


def test_from_env_reads_the_quick_reduce_size_cap_in_mib_and_the_bf16_cast():
    config = TailConfig.from_env(environ={"VLLM_ROCM_QUICK_REDUCE_QUANTIZATION": "INT4",
                                          "VLLM_ROCM_QUICK_REDUCE_MAX_SIZE_BYTES_MB": "512",
                                          "VLLM_ROCM_QUICK_REDUCE_CAST_BF16_TO_FP16": "0"})
    assert config.quantized_all_reduce_max_bytes == 512 * 2**20
    assert config.quantized_all_reduce_fp16_sizes_for_bf16 is False
    defaults = TailConfig.from_env(environ={})
    assert (defaults.all_reduce_quantization, defaults.quantized_all_reduce_max_bytes) == (None, 2**31)


def test_fused_output_is_reduced_is_the_deprecated_name_of_routed_output_is_reduced():
    with pytest.warns(DeprecationWarning, match="use routed_output_is_reduced"):
        config = TailConfig(hidden_size=96, latent_size=64, fused_output_is_reduced=True)
    assert config == TailConfig(hidden_size=96, latent_size=64, routed_output_is_reduced=True)
    with pytest.warns(DeprecationWarning, match="use routed_output_is_reduced"):
        assert config.fused_output_is_reduced is True


def test_both_names_of_a_reduced_routed_output_at_once_are_refused():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="fused_output_is_reduced: .* give only"):
        TailConfig(hidden_size=96, latent_size=64, fused_output_is_reduced=True, routed_output_is_reduced=True)
