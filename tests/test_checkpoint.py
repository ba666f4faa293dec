"""The tail from a Hugging Face checkpoint: TailConfig.from_hf_config, load_tail_weights, LatentMoETail.from_checkpoint.

The checkpoints are tiny ones in Kimi-K3's layout written here (tests/hf_checkpoint.py: H 20, L 8, layers
0 dense and 1-2 MoE, vision tensors beside them; three shards with an index, or one file; the wrapper's
``language_model.`` prefix or none). Every value is checked against the torch layout it was written in:
the kernel is the transpose of the stored [H, L] weight. H = 20 on 8 devices pads the column layout to
24 columns (blocks of 3, the last real one of 2, one block all padding). A config.json alone:
tests/test_hf_config.py; files written byte by byte in safetensors' layout: tests/test_safetensors_files.py.
"""

import dataclasses
import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors import SafetensorError, safe_open

import k3_tail
from helpers import make_tp_mesh
from hf_checkpoint import TinyModel, record_slices, tiny_model, write_checkpoint
from k3_tail.checkpoint import Checkpoint
from reference import TOLERANCE, TailInputs, make_inputs, reference_tail, relative_error

MODEL = TinyModel()
TENSORS = tiny_model(MODEL)
HIDDEN, LATENT = MODEL.hidden_size, MODEL.latent_size
CONFIG = k3_tail.TailConfig(hidden_size=HIDDEN, latent_size=LATENT, rms_norm_eps=1e-5, routed_scaling_factor=2.5)
BLOCK = "model.layers.{}.block_sparse_moe."
UP, NORM = BLOCK + "routed_expert_up_proj.weight", BLOCK + "routed_expert_norm.weight"



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


# TailConfig.from_hf_config of a checkpoint (the rest: tests/test_hf_config.py)


def test_from_hf_config_takes_a_safetensors_file_as_load_tail_weights_does(checkpoints, tmp_path):
    """A .safetensors file stands for the config.json beside it; a file without one is named."""
    (checkpoints["wrapped-file"].parent / "config.json").write_text(json.dumps(MODEL.config()))
    assert k3_tail.TailConfig.from_hf_config(checkpoints["wrapped-file"]) == CONFIG
    alone = write_checkpoint(tmp_path, TENSORS, single_file="alone.safetensors")
    with pytest.raises(ValueError, match=r"^config: no config\.json at '.*config\.json' \(beside the checkpoint file "
                                         r"'.*alone\.safetensors'\)$"):
        k3_tail.TailConfig.from_hf_config(alone)


def test_from_hf_config_names_what_it_wants_for_an_opened_checkpoint(checkpoints):
    with pytest.raises(ValueError, match=r"^config: expected a path to config\.json, .* got Checkpoint$"):
        k3_tail.TailConfig.from_hf_config(Checkpoint(checkpoints["wrapped-shards"]))


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
    return record_slices(monkeypatch)


def test_each_device_reads_only_its_own_columns_of_the_kernel(checkpoints, reads):
    """The column layout's callbacks ask safetensors for 7 disjoint runs of stored rows (the kernel's
    columns), each at most one block of 3, together the kernel once; the all-padding block reads nothing."""
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
    expected = "language_model.model.layers." if form.startswith("wrapped") else "model.layers."
    assert checkpoint.layers_prefix == expected
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
    (lambda path: (path / "model.safetensors.index.json").write_text('{"metadata": {}}') and path,
     r"^checkpoint: .*has no weight_map of tensor names to shard files"),
    (lambda path: (path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.layers.0.a": "a.safetensors", "model.layers.0.a": "b.safetensors"}}') and path,
     r"^weight_map\.model\.layers\.0\.a: duplicate key \(one JSON object gives it more than once\) \(in "
     r"'.*model\.safetensors\.index\.json'\)$"),
    (lambda path: (path / "model.safetensors.index.json").write_text("[" * 100_000) and path,
     r"^checkpoint: '.*model\.safetensors\.index\.json' nests arrays and objects deeper than the JSON parser goes$"),
], ids=["empty-directory", "index-without-weight-map", "index-duplicate-key", "index-deep"])
def test_a_malformed_checkpoint_is_a_value_error(make, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        Checkpoint(make(tmp_path))


@pytest.mark.parametrize("load", ["load_tail_weights", "from_hf_config"])
def test_an_empty_path_is_a_value_error_not_the_working_directory(load, checkpoints, monkeypatch):
    monkeypatch.chdir(checkpoints["wrapped-shards"])  # a checkpoint that "" taken for "." would load
    with pytest.raises(ValueError, match=r"^(checkpoint|config): expected a .*, got ''$"):
        if load == "load_tail_weights":
            k3_tail.load_tail_weights("", 1, config=CONFIG, mesh=make_tp_mesh(2))
        else:
            k3_tail.TailConfig.from_hf_config("")


# The index: shards are files of the checkpoint's own directory


def index_of(directory, weight_map):
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", "..", ".", "",
                                   "a\\b.safetensors"],
                         ids=["parent", "absolute", "subdirectory", "dot-dot", "dot", "empty", "backslash"])
def test_an_index_that_names_a_file_outside_its_directory_is_refused_naming_the_entry(shard, tmp_path):
    index_of(tmp_path, {"model.layers.0.a": "model-1.safetensors", "model.layers.0.b": shard})
    message = (rf"^checkpoint: '.*model\.safetensors\.index\.json': weight_map\.model\.layers\.0\.b: "
               rf"{re.escape(repr(shard))} is not a plain file name; a shard must be a file in the checkpoint's own "
               rf"directory")
    with pytest.raises(ValueError, match=message):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("shard", [3, ["model-1.safetensors"]], ids=["number", "list"])
def test_an_index_entry_that_is_no_file_name_at_all_is_refused_naming_it(shard, tmp_path):
    message = rf"weight_map\.model\.layers\.0\.a: expected a shard's file name, got {re.escape(repr(shard))}$"
    with pytest.raises(ValueError, match=message):
        Checkpoint(index_of(tmp_path, {"model.layers.0.a": shard}))


def test_the_hub_caches_snapshot_of_links_into_its_blobs_loads(tmp_path):
    """The Hugging Face hub's cache: snapshots/<revision>/<file> is a relative link to ../../blobs/<hash>."""
    written = write_checkpoint(tmp_path / "written", TENSORS, config=MODEL.config())
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "4f1e0c2"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, file in enumerate(sorted(written.iterdir())):
        file.rename(blobs / f"{number:040x}")
        (snapshot / file.name).symlink_to(f"../../blobs/{number:040x}")
    config = k3_tail.TailConfig.from_hf_config(snapshot)
    _, kernel = k3_tail.load_tail_weights(snapshot, 1, config=config, mesh=make_tp_mesh(2), weight_layout="replicated")
    np.testing.assert_array_equal(np.asarray(kernel), stored(UP, 1).T)


def test_a_tensor_the_index_maps_to_a_shard_that_lacks_it_is_named_with_the_shard(tmp_path):
    write_checkpoint(tmp_path, TENSORS)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = "language_model." + UP.format(1)
    elsewhere = next(shard for shard in sorted(set(index["weight_map"].values())) if shard != index["weight_map"][name])
    index["weight_map"][name] = elsewhere
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"^checkpoint: {re.escape(name)}: model\.safetensors\.index\.json maps it to "
                                         rf"'{elsewhere}', which holds no tensor of that name$"):
        k3_tail.load_tail_weights(tmp_path, 1, config=CONFIG, mesh=make_tp_mesh(2))


def test_a_missing_shard_is_named_when_a_tensor_in_it_is_read(tmp_path):
    checkpoint = Checkpoint(index_of(tmp_path, {"model.layers.0.a": "gone.safetensors"}))
    with pytest.raises(ValueError, match=r"^checkpoint: the shard .*gone\.safetensors' is missing"):
        checkpoint.read("model.layers.0.a")


def test_a_fifo_in_place_of_a_shard_is_refused_without_waiting_for_a_writer(tmp_path, fails_if_blocked):
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"^checkpoint: '.*model\.safetensors' is not a regular file; not read$"):
        Checkpoint(tmp_path)


# Layer names


def test_every_prefix_of_the_text_models_layers_is_read(tmp_path):
    """language_model.model.layers.N. (Kimi-K3), model.layers.N. (fixture forms above) and
    language_model.layers.N., which vLLM and SGLang accept too."""
    renamed = {("language_model." + name.removeprefix("model.")) if name.startswith("model.") else name: value
               for name, value in TENSORS.items()}
    path = write_checkpoint(tmp_path, renamed, wrapped=False, single_file="model.safetensors")
    checkpoint = Checkpoint(path)
    assert (checkpoint.layers_prefix, checkpoint.moe_layers()) == ("language_model.layers.", (1, 2))
    _, kernel = k3_tail.load_tail_weights(checkpoint, 2, config=CONFIG, mesh=make_tp_mesh(2),
                                          weight_layout="replicated")
    np.testing.assert_array_equal(np.asarray(kernel), stored(UP, 2).T)


@pytest.mark.parametrize(("name", "message"), [
    ("model.layers.01.block_sparse_moe.routed_expert_norm.weight",
     r"^checkpoint: language_model\.model\.layers\.01\.block_sparse_moe\.routed_expert_norm\.weight: "
     r"language_model\.model\.layers\.01\. is no decoder layer: a layer index is written in decimal without leading "
     r"zeros \(language_model\.model\.layers\.1\.\)"),
    ("model.layers.x.input_layernorm.weight", r"^checkpoint: .*layers\.x\.input_layernorm\.weight: .*layers\.x\. is no "
                                              r"decoder layer"),
    ("model.layers.1" + "0" * 30 + ".mlp.up_proj.weight", r"is no decoder layer: .* of at most 18 digits$"),
], ids=["leading-zero", "not-a-number", "too-many-digits"])
def test_a_layer_index_not_written_as_hugging_face_writes_one_is_refused_naming_the_tensor(name, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        Checkpoint(changed_checkpoint(tmp_path, {name: stored(NORM, 1)}))


def test_decoder_layers_under_two_prefixes_are_refused_as_ambiguous(tmp_path):
    path = changed_checkpoint(tmp_path, {"language_model.layers.1.mlp.up_proj.weight": stored(NORM, 1)}, wrapped=False)
    with pytest.raises(ValueError, match=r"^checkpoint: decoder layers under language_model\.layers\. and "
                                         r"model\.layers\.: which are the text model's is ambiguous$"):
        Checkpoint(path)


# A shard that changes under the reader, and what safetensors' numpy reader cannot return (the files
# safetensors itself refuses or accepts: tests/test_safetensors_files.py)


@pytest.mark.parametrize("change", ["truncated", "replaced"])
def test_a_shard_changed_after_it_was_opened_is_refused_before_it_is_read(change, tmp_path):
    """safetensors maps the file: a read past a truncated end would kill the process (SIGBUS)."""
    path = changed_checkpoint(tmp_path, {})
    checkpoint = Checkpoint(path)
    checkpoint.read("language_model." + UP.format(1))
    size = path.stat().st_size
    if change == "truncated":
        os.truncate(path, size - 64)
        with pytest.raises(SafetensorError, match="incomplete metadata"):
            safe_open(path, "numpy")
        expected = rf"its size went from {size} to {size - 64} bytes"
    else:
        replacement = write_checkpoint(tmp_path / "new", TENSORS, single_file="model.safetensors")
        os.replace(replacement, path)
        expected = "another file has taken its name"
    name = "language_model." + NORM.format(2)
    with pytest.raises(ValueError, match=rf"^checkpoint: '.*model\.safetensors': {re.escape(name)}: the file changed "
                                         rf"since it was opened \({expected}\); open the checkpoint again$"):
        checkpoint.read(name)


def test_a_tensor_safetensors_numpy_reader_does_not_return_is_refused_by_name(tmp_path):
    """In its numpy mode safetensors builds FP8 arrays from numpy.float8_e4m3fn, which numpy lacks."""
    name = "model.layers.1.block_sparse_moe.gate.weight_fp8"
    path = changed_checkpoint(tmp_path, {name: np.zeros((4, 2), jnp.float8_e4m3fn)})
    with safe_open(path, "numpy") as reference, pytest.raises(AttributeError, match="float8_e4m3fn"):
        reference.get_slice("language_model." + name)[0:1]
    checkpoint = Checkpoint(path)
    assert checkpoint.info("language_model." + name).dtype_name == "F8_E4M3"
    with pytest.raises(ValueError, match=rf"^language_model\.{re.escape(name)}: stored as F8_E4M3, which safetensors' "
                                         r"numpy reader does not return \(numpy has no such type\)"):
        checkpoint.read("language_model." + name, (slice(0, 1),))


def test_an_empty_block_reads_nothing(checkpoints, reads):
    """No byte is copied: the block's dtype is safetensors' answer to an empty read that it accepts."""
    block = Checkpoint(checkpoints["wrapped-file"]).read("language_model." + UP.format(1), (slice(3, 3),))
    assert block.shape == (0, LATENT) and block.dtype == CONFIG.dtype
    assert [size for _, _, size in reads] == [0]


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


# docs/guide.md's checkpoint section


def test_the_guides_checkpoint_section_prints_what_it_says(capsys):
    """Its ```python blocks, in order, in this process (tests/test_readme.py runs the whole guide in a fresh one),
    each compiled under its line of the guide so that a traceback points there: they print what their comments
    say."""
    guide = (Path(__file__).parent.parent / "docs" / "guide.md").read_text()
    start = guide.index("\n## A real checkpoint\n")
    end = guide.index("\n## ", start + 1)
    blocks = [(guide.count("\n", 0, match.start(1)) + 1, match.group(1))
              for match in re.finditer(r"^```python\n(.*?)^```$", guide[:end], re.MULTILINE | re.DOTALL)
              if match.start() > start]
    assert len(blocks) >= 2
    namespace = {"__name__": "guide"}
    for line, source in blocks:
        exec(compile("\n" * (line - 1) + source, "docs/guide.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "range(1, 3)" in printed and "layer 0: a dense layer" in printed
