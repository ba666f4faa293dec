"""A Hugging Face config.json read: TailConfig.from_hf_config (the fields the tail reads, their dtype, what it
refuses, naming the file's field) and hf_config's rule for which decoder layers are MoE. The config is the tiny
model's of tests/hf_checkpoint.py, or Kimi-K3's released one; tests/test_checkpoint.py reads checkpoints."""

import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import k3_tail
from hf_checkpoint import TinyModel
from k3_tail import hf_config

MODEL = TinyModel()
HIDDEN, LATENT = MODEL.hidden_size, MODEL.latent_size
CONFIG = k3_tail.TailConfig(hidden_size=HIDDEN, latent_size=LATENT, rms_norm_eps=1e-5, routed_scaling_factor=2.5)
# Kimi-K3's released text config (the fields the tail reads, and the layer structure).
RELEASED = {"hidden_size": 7168, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "rms_norm_eps": 1e-5,
            "routed_scaling_factor": 1.0, "torch_dtype": "bfloat16", "num_hidden_layers": 93,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 896, "num_experts_per_token": 16}


# TailConfig.from_hf_config


@pytest.mark.parametrize("source", ["nested-dict", "flat-dict", "config-json", "checkpoint-directory"])
def test_from_hf_config_reads_the_tail_fields(source, tmp_path):
    if source in ("nested-dict", "flat-dict"):
        config = MODEL.config() if source == "nested-dict" else MODEL.text_config()
    else:
        (tmp_path / "config.json").write_text(json.dumps(MODEL.config()))
        config = tmp_path / "config.json" if source == "config-json" else str(tmp_path)
    assert k3_tail.TailConfig.from_hf_config(config) == CONFIG


def test_the_released_kimi_k3_config_gives_the_kimi_k3_preset():
    assert k3_tail.TailConfig.from_hf_config({"text_config": RELEASED}) == k3_tail.TailConfig.kimi_k3()


def test_from_hf_config_takes_any_field_as_an_override():
    config = k3_tail.TailConfig.from_hf_config(MODEL.config(), up_proj_dtype="float8_e4m3fn",
                                               all_reduce_quantization="int8", rms_norm_eps=1e-3)
    assert (config.up_proj_dtype, config.all_reduce_quantization, config.rms_norm_eps) == (
        np.dtype(jnp.float8_e4m3fn), "int8", 1e-3)
    assert config.latent_size == LATENT


@pytest.mark.parametrize(("fields", "dtype"), [({"torch_dtype": "torch.float32"}, jnp.float32),
                                               ({"torch_dtype": None, "dtype": "float16"}, jnp.float16),
                                               ({"torch_dtype": None}, jnp.bfloat16)],
                         ids=["torch-prefixed", "dtype-key", "default"])
def test_the_dtype_comes_from_torch_dtype_or_dtype(fields, dtype):
    text = {key: value for key, value in {**MODEL.text_config(), **fields}.items() if value is not None}
    assert k3_tail.TailConfig.from_hf_config(text).dtype == np.dtype(dtype)


def test_the_wrappers_dtype_serves_a_text_config_that_names_none():
    text = {key: value for key, value in MODEL.text_config().items() if key != "torch_dtype"}
    config = k3_tail.TailConfig.from_hf_config({"torch_dtype": "float32", "text_config": text})
    assert config.dtype == np.dtype(jnp.float32)


def test_a_text_config_whose_torch_dtype_and_dtype_disagree_is_refused_naming_both():
    text = {**MODEL.text_config(), "torch_dtype": "torch.bfloat16", "dtype": "float32"}
    with pytest.raises(ValueError, match=r"^text_config\.torch_dtype and text_config\.dtype: they name different "
                                         r"dtypes, 'torch\.bfloat16' and 'float32'"):
        k3_tail.TailConfig.from_hf_config({"text_config": text})
    same = {**text, "dtype": "bfloat16"}  # the same dtype spelled both ways is no disagreement
    assert k3_tail.TailConfig.from_hf_config({"text_config": same}).dtype == np.dtype(jnp.bfloat16)


def test_a_model_without_a_latent_moe_is_refused():
    text = {key: value for key, value in MODEL.text_config().items() if key != "routed_expert_hidden_size"}
    with pytest.raises(ValueError, match=r"^text_config\.routed_expert_hidden_size: missing: this model has no "
                                         r"latent MoE"):
        k3_tail.TailConfig.from_hf_config({"text_config": text})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", 0, r"^text_config\.hidden_size: expected an integer >= 1, got 0"),
        ("hidden_size", True, r"^text_config\.hidden_size: expected an integer >= 1, got True"),
        ("routed_expert_hidden_size", 35.5, r"^text_config\.routed_expert_hidden_size: expected an integer"),
        ("rms_norm_eps", 0.0, r"^text_config\.rms_norm_eps: expected a finite number > 0, got 0\.0"),
        ("rms_norm_eps", "1e-5", r"^text_config\.rms_norm_eps: expected a finite number > 0, got '1e-5'"),
        ("rms_norm_eps", None, r"^text_config\.rms_norm_eps: missing from the model's config"),
        ("routed_scaling_factor", float("inf"), r"^text_config\.routed_scaling_factor: expected a finite number"),
        ("latent_moe_use_norm", "true", r"^text_config\.latent_moe_use_norm: expected true or false, got 'true'"),
        ("latent_moe_use_norm", None, r"^text_config\.latent_moe_use_norm: missing"),
        ("torch_dtype", "float64", r"^text_config\.torch_dtype: expected one of \('bfloat16', 'float16', 'float32'\)"),
    ],
    ids=["hidden-zero", "hidden-bool", "latent-float", "eps-zero", "eps-string", "eps-missing", "scale-inf",
         "norm-string", "norm-missing", "dtype-float64"],
)
def test_a_value_the_tail_cannot_serve_is_a_value_error_naming_the_field(field, value, message):
    text = {key: item for key, item in {**MODEL.text_config(), field: value}.items() if item is not None}
    with pytest.raises(ValueError, match=message):
        k3_tail.TailConfig.from_hf_config({"text_config": text})


@pytest.mark.parametrize(("config", "message"), [
    ("missing-dir", r"^config: no config\.json at"),
    ({"text_config": [1]}, r"^text_config: expected a JSON object, got list"),
    (7, r"^config: expected a path to config\.json, a checkpoint directory or a \.safetensors file, or the config "
        r"as a dict, got int"),
    ({"hidden_size": 16}, r"^routed_expert_hidden_size: missing"),
], ids=["no-config-json", "text-config-list", "not-a-config", "flat-names-unprefixed"])
def test_a_config_that_cannot_be_read_is_a_value_error(config, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        k3_tail.TailConfig.from_hf_config(tmp_path / config if config == "missing-dir" else config)


@pytest.mark.parametrize(("field", "value"), [("rms_norm_eps", 1e-40), ("routed_scaling_factor", 1e39)],
                         ids=["eps-subnormal-in-float32", "scale-beyond-float32"])
def test_a_number_float32_cannot_hold_is_named_as_the_config_spells_it(field, value):
    """TailConfig holds both to float32's normal range; the message names the file's field."""
    text = {**MODEL.text_config(), field: value}
    with pytest.raises(ValueError, match=rf"^text_config\.{field}: expected .*that float32 holds as a normal number"):
        k3_tail.TailConfig.from_hf_config({"text_config": text})


def test_keys_that_begin_with_an_underscore_are_fields_like_any_other():
    """Nothing the reader knows about a config (where its fields sit, the wrapper's dtype) is kept among its
    fields, so no key of the file can stand in for it."""
    text = {key: value for key, value in MODEL.text_config().items() if key != "torch_dtype"}
    planted = {**text, "_where": "evil.", "_wrapper": {"torch_dtype": "float32"}, "hidden_size": 0}
    with pytest.raises(ValueError, match=r"^hidden_size: expected an integer >= 1, got 0$"):
        k3_tail.TailConfig.from_hf_config(planted)
    planted["hidden_size"] = HIDDEN
    assert k3_tail.TailConfig.from_hf_config(planted) == CONFIG


@pytest.mark.parametrize(("text", "message"), [
    ('{"text_config": {"hidden_size": 20, "hidden_size": 24}}',
     r"^text_config\.hidden_size: duplicate key \(one JSON object gives it more than once\) \(in '.*config\.json'\)$"),
    ('{"text_config": ' * 50_000 + "{}" + "}" * 50_000, r"^config: '.*config\.json' nests arrays and objects deeper"),
    ('{"text_config": {"hidden_size": 1' + "0" * 5000 + "}}", r"^config: '.*config\.json' is not JSON \(an integer of "
                                                           r"5001 digits"),
    ('["not", "an", "object"]', r"^config: '.*config\.json' holds a JSON list, not an object$"),
], ids=["duplicate-key", "deep", "digits", "array"])
def test_a_config_json_that_is_not_strict_json_is_a_value_error_naming_the_file(text, message, tmp_path):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        k3_tail.TailConfig.from_hf_config(tmp_path)


# Which layers are MoE: hf_config


@pytest.mark.parametrize(("fields", "expected"), [
    ({"num_hidden_layers": 93, "first_k_dense_replace": 1}, range(1, 93)),
    ({"num_hidden_layers": 7, "first_k_dense_replace": 1, "moe_layer_freq": 2}, range(2, 7, 2)),
    ({"num_hidden_layers": 10, "first_k_dense_replace": 3, "moe_layer_freq": 3}, range(3, 10, 3)),
    ({"num_hidden_layers": 10, "first_k_dense_replace": 4, "moe_layer_freq": 3}, range(6, 10, 3)),
    ({"num_hidden_layers": 4}, range(4)),
    ({"num_hidden_layers": 2, "first_k_dense_replace": 5}, range(5, 2)),
], ids=["kimi-k3", "every-second", "first-on-the-rule", "first-between", "defaults", "all-dense"])
def test_a_layer_is_moe_from_first_k_dense_replace_on_where_its_index_is_a_multiple_of_moe_layer_freq(fields,
                                                                                                   expected):
    """The reference model's rule (vLLM's and SGLang's too): i >= first_k_dense_replace and
    i % moe_layer_freq == 0; moe_layers and is_moe_layer agree on every layer."""
    config = {**fields, "num_experts": 8}
    assert hf_config.moe_layers(config) == expected
    assert [layer for layer in range(fields["num_hidden_layers"]) if hf_config.is_moe_layer(config, layer)] == list(
        expected)


def test_the_moe_layers_of_a_config_with_a_trillion_layers_are_a_range_at_once():
    layers = hf_config.moe_layers({"num_hidden_layers": 10**12, "first_k_dense_replace": 1, "moe_layer_freq": 2,
                                   "num_experts": 8})
    assert layers == range(2, 10**12, 2) and len(layers) == 5 * 10**11 - 1


def test_a_layer_count_beyond_a_range_is_a_value_error():
    with pytest.raises(ValueError, match=rf"^num_hidden_layers: expected at most {sys.maxsize} layers"):
        hf_config.moe_layers({"num_hidden_layers": sys.maxsize + 1, "num_experts": 8})


@pytest.mark.parametrize("ask", ["moe_layers", "is_moe_layer"])
def test_a_config_with_moe_layers_but_no_expert_count_is_a_value_error(ask):
    text = {key: value for key, value in RELEASED.items() if key != "num_experts"}
    with pytest.raises(ValueError, match=r"^text_config\.num_experts: missing from the model's config, which has MoE "
                                         r"layers"):
        hf_config.moe_layers({"text_config": text}) if ask == "moe_layers" else hf_config.is_moe_layer(
            {"text_config": text}, 5)
    assert not hf_config.is_moe_layer({"text_config": text}, 0)  # a dense layer needs no experts


def test_a_layer_past_the_models_last_is_no_moe_layer_but_an_error():
    with pytest.raises(ValueError, match=r"^layer: expected a decoder layer 0\.\.92 \(text_config\.num_hidden_layers"):
        hf_config.is_moe_layer({"text_config": RELEASED}, 93)
