"""The example Kimi-K3 layer from a Hugging Face checkpoint (k3_tail/models/kimi_k3/checkpoint.py).

A tiny model in Kimi-K3's layout (tests/hf_checkpoint.py: H 16, L 8, 4 experts of width 8, top 2, two
shared experts stored as one MLP of width 16; layer 0 dense, 1-2 MoE; wrapper prefix, three shards) on 4
devices: every parameter is the stored tensor in Flax layout, each rank reads only its slice of every
expert, and the loaded layer computes what the layer built in memory from the same numbers computes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FAST_COMPILE_OPTIONS, make_tp_mesh
from hf_checkpoint import TinyModel, moe_layer_weights, record_reads, tiny_model, write_checkpoint
from k3_tail.models.kimi_k3 import LayerConfig, layer as layer_module, layer_parameters, partition_specs
from k3_tail.models.kimi_k3.checkpoint import layer_config_from_hf, load_layer
from k3_tail.models.kimi_k3.packed_parameters import held_partition_specs
from k3_tail.models.kimi_k3.reference import reference_layer
from reference import TOLERANCE, relative_error

MODEL = TinyModel(hidden_size=16)
TENSORS = tiny_model(MODEL, seed=1)
TP_SIZE, LAYER, TOKENS = 4, 2, 4
MOE = f"model.layers.{LAYER}.block_sparse_moe."
# The layer's weights as the loader should read them, made here from the torch-layout tensors.
IN_MEMORY_WEIGHTS = moe_layer_weights(TENSORS, LAYER, MODEL.num_experts)
layer_forward = jax.jit(layer_module.layer_forward, static_argnames=("config", "mesh", "axis_name", "weight_layout",
                                                                      "tier"), compiler_options=FAST_COMPILE_OPTIONS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("kimi") / "ckpt", TENSORS, config=MODEL.config())


@pytest.fixture(scope="module")
def config(checkpoint):
    return layer_config_from_hf(checkpoint)


def test_the_layer_config_comes_from_the_models_config(config):
    assert (config.num_experts, config.top_k, config.expert_intermediate_size, config.shared_intermediate_size) == (
        4, 2, 8, 16)
    tail = config.tail
    assert (tail.hidden_size, tail.latent_size, tail.rms_norm_eps, tail.routed_scaling_factor) == (16, 8, 1e-5, 2.5)
    assert tail.shared_output_is_reduced  # the layer's early shared reduction, its default


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hidden_act", "silu", r"^text_config\.hidden_act: this layer computes 'situ', got 'silu'"),
    ("activation_situ_linear_beta", 20.0, r"^text_config\.activation_situ_linear_beta: this layer's SiTU uses 25"),
    ("moe_renormalize", False, r"^text_config\.moe_renormalize: this layer renormalises the top-k weights"),
    ("num_experts", None, r"^text_config\.num_experts: missing"),
], ids=["activation", "situ-beta", "no-renormalisation", "no-experts"])
def test_a_model_the_layer_does_not_compute_is_refused(field, value, message):
    text = {key: item for key, item in {**MODEL.text_config(), field: value}.items() if item is not None}
    with pytest.raises(ValueError, match=message):
        layer_config_from_hf({"text_config": text})


@pytest.mark.parametrize(("text", "message"), [
    ('{"text_config": {"num_experts": 4, "num_experts": 8}}',
     r"^text_config\.num_experts: duplicate key .*config\.json"),
    ('{"text_config": {"num_experts": 1' + "0" * 5000 + "}}",
     r"^config: '.*config\.json' is not JSON \(an integer of "),
], ids=["duplicate-key", "digits"])
def test_the_layer_config_reads_config_json_as_strict_json(text, message, tmp_path):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        layer_config_from_hf(tmp_path)


def test_a_mesh_without_the_tp_axis_is_a_value_error_naming_the_axis(checkpoint, config):
    mesh = jax.make_mesh((TP_SIZE,), ("model",), devices=jax.devices()[:TP_SIZE])
    with pytest.raises(ValueError, match=r"^mesh: expected a mesh axis named 'tp' \(axis_name\), got axes "
                                         r"\('model',\)"):
        load_layer(checkpoint, LAYER, config=config, mesh=mesh)


def test_the_kimi_k3_preset_has_the_released_eps():
    assert LayerConfig.kimi_k3().tail.rms_norm_eps == 1e-5


@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
def test_every_parameter_is_the_stored_tensor_in_flax_layout_placed_as_the_layer_places_it(weight_layout, checkpoint,
                                                                                            config):
    layer = load_layer(checkpoint, LAYER, config=config, mesh=make_tp_mesh(TP_SIZE), weight_layout=weight_layout)
    values = layer.checkpoint_values()
    assert set(values) == set(IN_MEMORY_WEIGHTS)
    for name, value in values.items():
        assert value.dtype == np.dtype(layer_parameters(config)[name].dtype), name
        np.testing.assert_array_equal(np.asarray(value), IN_MEMORY_WEIGHTS[name].astype(value.dtype), err_msg=name)
    specs = held_partition_specs(config, TP_SIZE, weight_layout=weight_layout)
    assert {name: value.sharding.spec for name, value in layer.parameter_values().items()} == specs


@pytest.fixture
def reads(monkeypatch):
    return record_reads(monkeypatch)


def test_each_rank_reads_only_its_slice_of_every_expert(checkpoint, config, reads):
    """w1 and w3 [m, L]: rank i reads rows [2i, 2i + 2); w2 [L, m]: those columns; each once."""
    load_layer(checkpoint, LAYER, config=config, mesh=make_tp_mesh(TP_SIZE))
    width = MODEL.expert_width // TP_SIZE
    slices = [(rank * width, (rank + 1) * width) for rank in range(TP_SIZE)]
    for expert in range(MODEL.num_experts):
        for weight, axis in (("w1", 0), ("w3", 0), ("w2", 1)):
            name = f"language_model.{MOE}experts.{expert}.{weight}.weight"
            read = sorted((index[axis].start, index[axis].stop) for tensor, index, _ in reads if tensor == name)
            assert read == slices, name


@pytest.fixture(scope="module")
def outputs(checkpoint, config):
    """(x, y of the loaded layer, y of the layer built in memory from the same numbers), column layout."""
    mesh = make_tp_mesh(TP_SIZE)
    loaded = load_layer(checkpoint, LAYER, config=config, mesh=mesh, weight_layout="column")
    memory = layer_module.KimiK3MoELayer(config, mesh, IN_MEMORY_WEIGHTS, weight_layout="column")
    x = np.asarray(jnp.asarray(np.random.default_rng(0).standard_normal((TOKENS, MODEL.hidden_size)), config.dtype))
    run = [layer_forward(layer.parameter_values(), jnp.asarray(x), config=config, mesh=mesh, weight_layout="column")
           for layer in (loaded, memory)]
    return x, *(np.asarray(y) for y in run)


def test_the_loaded_layer_computes_what_the_layer_built_in_memory_computes(outputs):
    _, loaded, memory = outputs
    np.testing.assert_array_equal(loaded, memory)


def test_the_loaded_layer_matches_the_float64_reference(outputs, config):
    x, loaded, _ = outputs
    expected = reference_layer(IN_MEMORY_WEIGHTS, x, top_k=config.top_k, rms_norm_eps=config.tail.rms_norm_eps,
                               routed_scaling_factor=config.tail.routed_scaling_factor)
    assert relative_error(loaded, expected) <= TOLERANCE[config.dtype]


def test_an_fp8_up_projection_is_quantised_at_load(checkpoint):
    config = layer_config_from_hf(checkpoint, up_proj_dtype="float8_e4m3fn")
    values = load_layer(checkpoint, LAYER, config=config, mesh=make_tp_mesh(TP_SIZE),
                        weight_layout="column").parameter_values()
    assert values["up_proj_kernel"].dtype == jnp.float8_e4m3fn and values["up_proj_scale"].dtype == jnp.float32
    assert values["up_proj_scale"].sharding.spec == partition_specs(config, TP_SIZE,
                                                                   weight_layout="column")["up_proj_scale"]


def quantised_experts(tensors):
    """``tensors`` with every routed expert's weight as compressed-tensors' MXFP4 stores it (packed values
    and group scales in place of ``weight``)."""
    changed = {}
    for name, value in tensors.items():
        if ".experts." in name:
            stem = name.removesuffix(".weight")
            changed[f"{stem}.weight_packed"] = np.zeros((value.shape[0], value.shape[1] // 2), np.uint8)
            changed[f"{stem}.weight_scale"] = np.zeros((value.shape[0], max(1, value.shape[1] // 32)), np.uint8)
        else:
            changed[name] = value
    return changed


def test_quantised_routed_experts_under_a_bf16_config_are_refused_naming_the_tensors_found(tmp_path, config):
    whole = {**MODEL.config(), "quantization_config": {"quant_method": "compressed-tensors",
                                                       "format": "mxfp4-pack-quantized"}}
    path = write_checkpoint(tmp_path, quantised_experts(TENSORS), config=whole)
    message = (r"^layer 2: the routed experts are stored quantised \(language_model\.model\.layers\.2\.block_sparse_moe"
               r"\.experts\.0\.w1\.weight_packed, .* and \d+ more; config\.json: quantization_config "
               r"compressed-tensors, mxfp4-pack-quantized\); this LayerConfig holds them in bfloat16 "
               r"\(expert_quantization=None\): .* load with LayerConfig\(expert_quantization='mxfp4'\)")
    with pytest.raises(ValueError, match=message):
        load_layer(path, LAYER, config=config, mesh=make_tp_mesh(TP_SIZE))


@pytest.mark.parametrize(("change", "layer", "message"), [
    ({}, 0, r"^layer 0: a dense layer"),
    ({f"{MOE}experts.3.w2.weight": np.zeros((8, 8 + 1), np.float32)}, LAYER,
     r"^layer 2: .*experts\.3\.w2\.weight: expected shape \(8, 8\) \(torch's \[out, in\] of one expert's expert_down\) "
     r"of bfloat16 \(config\.dtype\), got shape \(8, 9\) of float32$"),
    ({f"{MOE}shared_experts.up_proj.weight": None}, LAYER,
     r"^layer 2: .*shared_experts\.up_proj\.weight: missing from the checkpoint \(expected shape \(16, 16\)"),
], ids=["dense-layer", "expert-shape", "missing-shared-expert"])
def test_a_bad_layer_or_tensor_is_a_value_error_naming_it(change, layer, message, tmp_path, config):
    tensors = {name: value for name, value in {**TENSORS, **change}.items() if value is not None}
    path = write_checkpoint(tmp_path, tensors, single_file="model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_layer(path, layer, config=config, mesh=make_tp_mesh(TP_SIZE))

