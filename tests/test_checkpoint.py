"""The tail from a Hugging Face checkpoint: TailConfig.from_hf_config, load_tail_weights, LatentMoETail.from_checkpoint.

The checkpoints are tiny ones in Kimi-K3's layout written here (tests/hf_checkpoint.py: H 20, L 8, layers
0 dense and 1-2 MoE, vision tensors beside them; three shards with an index, or one file; the wrapper's
``language_model.`` prefix or none). Every value is checked against the torch layout it was written in:
the kernel is the transpose of the stored [H, L] weight. H = 20 on 8 devices pads the column layout to
24 columns (blocks of 3, the last real one of 2, one block all padding).
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

import k3_tail
from hf_checkpoint import TinyModel, record_reads, tiny_model, write_checkpoint
from helpers import make_tp_mesh
from k3_tail import hf_config
from k3_tail.checkpoint import Checkpoint
from reference import TOLERANCE, TailInputs, make_inputs, reference_tail, relative_error

MODEL = TinyModel()
TENSORS = tiny_model(MODEL)
HIDDEN, LATENT = MODEL.hidden_size, MODEL.latent_size
CONFIG = k3_tail.TailConfig(hidden_size=HIDDEN, latent_size=LATENT, rms_norm_eps=1e-5, routed_scaling_factor=2.5)
BLOCK = "model.layers.{}.block_sparse_moe."
UP, NORM = BLOCK + "routed_expert_up_proj.weight", BLOCK + "routed_expert_norm.weight"
# Kimi-K3's released text config (the fields the tail reads, and the layer structure).
RELEASED = {"hidden_size": 7168, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "rms_norm_eps": 1e-5,
            "routed_scaling_factor": 1.0, "torch_dtype": "bfloat16", "num_hidden_layers": 93,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 896, "num_experts_per_token": 16}


def stored(name, layer):
    return TENSORS[name.format(layer)]


FORMS = ("wrapped-shards", "unprefixed-shards", "wrapped-file", "unprefixed-model-safetensors")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same model in each form a checkpoint comes in, by name: the path to load from."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "wrapped-shards": write_checkpoint(root / "wrapped", TENSORS, config=MODEL.config()),
        "unprefixed-shards": write_checkpoint(root / "flat", TENSORS, config=MODEL.text_config(), wrapped=False,
                                              shards=2),
        "wrapped-file": write_checkpoint(root / "file", TENSORS, single_file="kimi.safetensors"),
        "unprefixed-model-safetensors": write_checkpoint(root / "single", TENSORS, wrapped=False,
                                                         single_file="model.safetensors").parent,
    }


def changed_checkpoint(directory, changes, *, removed=(), wrapped=True):
    """The tiny model with ``changes`` (name -> array) and without ``removed`` names, as one file."""
    tensors = {name: value for name, value in {**TENSORS, **changes}.items() if name not in removed}
    return write_checkpoint(directory, tensors, wrapped=wrapped, single_file="model.safetensors")


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
    (7, r"^config: expected a path to config\.json, a checkpoint directory or a dict, got int"),
    ({"hidden_size": 16}, r"^routed_expert_hidden_size: missing"),
], ids=["no-config-json", "text-config-list", "not-a-config", "flat-names-unprefixed"])
def test_a_config_that_cannot_be_read_is_a_value_error(config, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        k3_tail.TailConfig.from_hf_config(tmp_path / config if config == "missing-dir" else config)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"num_hidden_layers": 93, "first_k_dense_replace": 1}, tuple(range(1, 93))),
    ({"num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2}, (1, 3, 5)),
    ({"num_hidden_layers": 4}, (0, 1, 2, 3)),
], ids=["kimi-k3", "every-second", "defaults"])
def test_the_moe_layers_follow_first_k_dense_replace_and_moe_layer_freq(fields, expected):
    assert hf_config.moe_layers(fields) == expected


def test_a_layer_past_the_models_last_is_no_moe_layer_but_an_error():
    with pytest.raises(ValueError, match=r"^layer: expected a decoder layer 0\.\.92 \(text_config\.num_hidden_layers"):
        hf_config.is_moe_layer({"text_config": RELEASED}, 93)


# load_tail_weights


@pytest.mark.parametrize("form", FORMS)
def test_the_column_kernel_is_the_transpose_of_the_stored_weight_padded_and_sharded(form, checkpoints):
    norm, kernel = k3_tail.load_tail_weights(checkpoints[form], 2, config=CONFIG, mesh=make_tp_mesh(8))
    assert kernel.shape == (LATENT, 24) and kernel.sharding.spec == P(None, "tp")
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(LATENT, 3)}
    np.testing.assert_array_equal(np.asarray(kernel)[:, :HIDDEN], stored(UP, 2).T)
    np.testing.assert_array_equal(np.asarray(kernel)[:, HIDDEN:], 0)
    assert norm.sharding.spec == P() and norm.dtype == CONFIG.dtype
    np.testing.assert_array_equal(np.asarray(norm), stored(NORM, 2))


def test_the_replicated_kernel_is_whole_on_every_device(checkpoints):
    _, kernel = k3_tail.load_tail_weights(checkpoints["wrapped-shards"], 1, config=CONFIG, mesh=make_tp_mesh(8),
                                          weight_layout="replicated")
    assert kernel.sharding.is_fully_replicated
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(LATENT, HIDDEN)}
    np.testing.assert_array_equal(np.asarray(kernel), stored(UP, 1).T)


@pytest.fixture
def reads(monkeypatch):
    return record_reads(monkeypatch)


def test_each_device_reads_only_its_own_columns_of_the_kernel(checkpoints, reads):
    """The column layout's callbacks read 7 disjoint runs of stored rows (the kernel's columns), each at
    most one block of 3, together the kernel once; the all-padding block reads nothing."""
    k3_tail.load_tail_weights(checkpoints["wrapped-shards"], 1, config=CONFIG, mesh=make_tp_mesh(8))
    kernel_reads = [(index, size) for name, index, size in reads if name.endswith("routed_expert_up_proj.weight")]
    rows = sorted((index[0].start, index[0].stop) for index, _ in kernel_reads)
    assert rows == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 18), (18, 20)]
    row_bytes = LATENT * 2
    assert [size for _, size in sorted(kernel_reads, key=lambda read: read[0][0].start)] == [
        (stop - start) * row_bytes for start, stop in rows]
    assert sum(size for _, size in kernel_reads) == HIDDEN * row_bytes


@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
def test_an_fp8_kernel_is_quantised_at_load_as_quantize_up_proj_quantises_it(weight_layout, checkpoints):
    """Per block in the column layout: each column's scale needs only its own column, so the blocks
    quantised apart equal the whole kernel quantised at once; padding columns' values and scales are zero
    (as LatentMoETail pads them)."""
    config = dataclasses.replace(CONFIG, up_proj_dtype="float8_e4m3fn")
    _, kernel = k3_tail.load_tail_weights(checkpoints["unprefixed-shards"], 1, config=config, mesh=make_tp_mesh(8),
                                          weight_layout=weight_layout)
    expected = k3_tail.quantize_up_proj(stored(UP, 1).T, "float8_e4m3fn")
    width = 24 if weight_layout == "column" else HIDDEN
    values, scale = np.asarray(kernel.values, np.float32), np.asarray(kernel.scale)
    assert kernel.values.dtype == jnp.float8_e4m3fn and values.shape == (LATENT, width)
    np.testing.assert_array_equal(values[:, :HIDDEN], np.asarray(expected.values, np.float32))
    np.testing.assert_array_equal(scale[:HIDDEN], np.asarray(expected.scale))
    np.testing.assert_array_equal(values[:, HIDDEN:], 0)
    np.testing.assert_array_equal(scale[HIDDEN:], 0)
    specs = (P(None, "tp"), P("tp")) if weight_layout == "column" else (P(), P())
    assert (kernel.values.sharding.spec, kernel.scale.sharding.spec) == specs


def test_the_norm_weight_is_none_without_the_norm(tmp_path):
    path = changed_checkpoint(tmp_path, {}, removed=[NORM.format(1)])
    norm, _ = k3_tail.load_tail_weights(path, 1, config=dataclasses.replace(CONFIG, use_latent_norm=False),
                                        mesh=make_tp_mesh(2))
    assert norm is None


@pytest.mark.parametrize("form", ["wrapped-shards", "unprefixed-shards"])
def test_the_layout_is_detected_and_the_vision_tensors_left_aside(form, checkpoints):
    checkpoint = Checkpoint(checkpoints[form])
    assert checkpoint.prefix == ("language_model." if form.startswith("wrapped") else "")
    assert (checkpoint.layers, checkpoint.moe_layers()) == ((0, 1, 2), (1, 2))
    assert "vision_tower.blocks.0.attn.qkv.weight" in checkpoint


def test_every_tensor_reads_as_safetensors_reads_it(checkpoints):
    path = checkpoints["wrapped-file"]
    checkpoint = Checkpoint(path)
    with safe_open(str(path), "numpy") as reference:
        assert sorted(checkpoint.names) == sorted(reference.keys())
        for name in reference.keys():
            expected = reference.get_tensor(name)
            actual = checkpoint.read(name)
            assert actual.dtype == expected.dtype
            np.testing.assert_array_equal(actual, expected)


# Bad layers, tensors and checkpoints: (changes, removed names, config changes, layer, message)
ERRORS = {
    "dense-layer": ({}, (), {}, 0, r"^layer 0: a dense layer \(its feed-forward block is 'mlp', not "
                                   r"'block_sparse_moe'\): .* the MoE layers here are 1\.\.2$"),
    "past-the-last": ({}, (), {}, 3, r"^layer 3: past the last layer: the checkpoint has layers 0\.\.2$"),
    "negative-layer": ({}, (), {}, -1, r"^layer: expected an integer >= 0, got -1"),
    "missing-norm": ({}, (NORM.format(1),), {}, 1,
                     r"^layer 1: language_model\.model\.layers\.1\.block_sparse_moe\.routed_expert_norm\.weight: "
                     r"missing from the checkpoint \(expected shape \(8,\) \(\[L\] = \[8\]: the latent RMSNorm scale\) "
                     r"of bfloat16 \(config\.dtype\)\)$"),
    "kernel-stored-untransposed": ({UP.format(1): np.ascontiguousarray(stored(UP, 1).T)}, (), {}, 1,
                                   r"^layer 1: .*routed_expert_up_proj\.weight: expected shape \(20, 8\) \(\[H, L\] = "
                                   r"\[20, 8\]: torch's \[out, in\] of the up projection\) of bfloat16 "
                                   r"\(config\.dtype\), got shape \(8, 20\) of bfloat16$"),
    "other-dtype": ({}, (), {"dtype": jnp.float32}, 1,
                    r"^layer 1: .*routed_expert_up_proj\.weight: expected shape \(20, 8\) .* of float32 "
                    r"\(config\.dtype\), got shape \(20, 8\) of bfloat16$"),
    "kernel-quantised": ({UP.format(1) + "_packed": np.zeros((HIDDEN, LATENT // 2), np.uint8),
                          UP.format(1) + "_scale": np.zeros((HIDDEN, 1), np.uint8)}, (UP.format(1),), {}, 1,
                         r"^layer 1: .*routed_expert_up_proj\.weight: missing; the checkpoint holds "
                         r"\[.*routed_expert_up_proj\.weight_packed', .*weight_scale'\] instead: the tensor is "
                         r"stored quantised"),
    "norm-present-but-off": ({}, (), {"use_latent_norm": False}, 1,
                             r"^layer 1: .*routed_expert_norm\.weight: the checkpoint has the latent norm's scale but "
                             r"config\.use_latent_norm is False"),
    "other-sizes": ({}, (), {"hidden_size": 24}, 2, r"^layer 2: .*up_proj\.weight: expected shape \(24, 8\)"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_a_bad_layer_or_tensor_is_a_value_error_naming_the_layer_the_tensor_and_what_was_expected(case, tmp_path):
    changes, removed, config_changes, layer, message = ERRORS[case]
    path = changed_checkpoint(tmp_path, changes, removed=removed)
    with pytest.raises(ValueError, match=message):
        k3_tail.load_tail_weights(path, layer, config=dataclasses.replace(CONFIG, **config_changes),
                                  mesh=make_tp_mesh(2))


@pytest.mark.parametrize(("make", "message"), [
    (lambda path: path, r"^checkpoint: expected a directory with model\.safetensors\.index\.json or "
                        r"model\.safetensors, or a \.safetensors file"),
    (lambda path: (path / "x.safetensors").write_bytes(b"\xff" * 16) and path / "x.safetensors",
     r"^checkpoint: .*x\.safetensors' is not a safetensors file \(no header\)"),
    (lambda path: (path / "model.safetensors.index.json").write_text('{"metadata": {}}') and path,
     r"^checkpoint: .*has no weight_map of tensor names to shard files"),
], ids=["empty-directory", "not-safetensors", "index-without-weight-map"])
def test_a_malformed_checkpoint_is_a_value_error(make, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        Checkpoint(make(tmp_path))


def test_a_missing_shard_is_named_when_a_tensor_in_it_is_read(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"model.layers.0.a": "gone.safetensors"}}')
    checkpoint = Checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"^checkpoint: the shard .*gone\.safetensors' is missing"):
        checkpoint.read("model.layers.0.a")


# LatentMoETail.from_checkpoint


@pytest.mark.parametrize(("weight_layout", "up_proj_dtype"), [("column", None), ("replicated", None),
                                                             ("column", "float8_e4m3fn")],
                         ids=["column", "replicated", "column-fp8"])
def test_a_module_from_a_checkpoint_holds_the_loaded_weights_with_their_sharding(weight_layout, up_proj_dtype,
                                                                                 checkpoints):
    """The parameters LatentMoETail holds after load_up_proj of the stored kernel's transpose (FP8 values
    and scales too), the stored norm scale, and the same sharding metadata."""
    config = dataclasses.replace(CONFIG, up_proj_dtype=up_proj_dtype)
    module = k3_tail.LatentMoETail.from_checkpoint(checkpoints["wrapped-shards"], 1, config=config,
                                                   mesh=make_tp_mesh(8), weight_layout=weight_layout)
    memory = k3_tail.LatentMoETail(config, make_tp_mesh(8), rngs=nnx.Rngs(0), weight_layout=weight_layout)
    memory.load_up_proj(stored(UP, 1).T)
    for name in ("up_proj_kernel", "up_proj_scale"):
        loaded, expected = getattr(module, name), getattr(memory, name)
        assert (loaded is None) == (expected is None) == (name == "up_proj_scale" and up_proj_dtype is None)
        if loaded is not None:
            np.testing.assert_array_equal(np.asarray(loaded[...], np.float32), np.asarray(expected[...], np.float32))
    np.testing.assert_array_equal(np.asarray(module.norm_scale[...]), stored(NORM, 1))
    specs = nnx.get_partition_spec(nnx.state(module, nnx.Param))
    assert specs == nnx.get_partition_spec(nnx.state(memory, nnx.Param))


def test_a_module_from_a_checkpoint_computes_the_tail_of_the_stored_numbers(checkpoints):
    """Its y equals tail_forward's on the stored numbers held in memory, and the float64 reference's."""
    mesh = make_tp_mesh(8)
    module = k3_tail.LatentMoETail.from_checkpoint(checkpoints["unprefixed-shards"], 2, config=CONFIG, mesh=mesh)
    partials = make_inputs(CONFIG, 8, 4)
    y = module(partials.routed, partials.shared)
    in_memory = k3_tail.tail_forward(partials.routed, partials.shared, stored(NORM, 2), stored(UP, 2).T,
                                     config=CONFIG, mesh=mesh, weight_layout="column")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(in_memory))
    inputs = TailInputs(partials.routed, partials.shared, stored(NORM, 2), stored(UP, 2).T)
    assert relative_error(y, reference_tail(CONFIG, inputs)) <= TOLERANCE[CONFIG.dtype]
