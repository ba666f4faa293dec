"""The Kimi-K3 loader (k3_tail.models.kimi_k3.checkpoint) against a checkpoint that compressed-tensors' own compressor
wrote: an independent check of the format, which tests/test_kimi_k3_mxfp4.py checks with the tests' own encoder.

A tiny model in Kimi-K3's layout (tests/hf_checkpoint.py: H 16, L 128, 4 experts of width m = 64, top 2, on p = 2
CPU devices) goes through compressed-tensors' pipeline for MXFP4 weights as llm-compressor drives it: its Linear
weights as torch Linear modules of the checkpoint's names, ``apply_quantization_config`` with the ``MXFP4A16``
preset (4-bit float weights in groups of 32, E8M0 scales as uint8, activations unquantised) on every Linear but
those Kimi-K3 keeps in bf16 (the ``ignore`` list: only the routed experts are quantised), each group's scale from
its minimum and maximum by ``compute_dynamic_scales_and_zp`` (``calculate_qparams`` over groups of 32, as
llm-compressor's min-max weight observer computes it), then ``ModelCompressor.from_pretrained_model`` and
``compress_model``: the checkpoint holds the compressed state dict (safetensors' writer), and its config.json the
``quantization_config`` that ``ModelCompressor.update_config`` writes, moved under ``text_config`` as Kimi-K3 has it.
The same compressor's ``decompress_model`` gives the bf16 weights those bytes stand for; a second checkpoint holds
them as plain ``weight`` tensors.

The experts' weights span several binades in every row (each group of 32 input columns under its own power of
two), with exact zeros, negative zeros and one all-zero group in every tensor (compressed-tensors gives it the scale
2^-127, u = 0), and one group of values near bf16's smallest normal, some of them bf16 subnormals (u = 0 or 1: the
library's CPU decoder builds those values from their bits). From finite bf16 weights compressed-tensors writes no
scale byte of 255, where it and the library differ: its ``decompress`` computes 2^(255 - 127) = inf, the library
(the OCP MX rule) NaN.

Marked ``compressed_tensors``: they need the compressed-tensors package (and torch), which .ci/run installs in an
environment of their own (.venv-compressed-tensors) and runs them with K3_TAIL_REQUIRE_COMPRESSED_TENSORS set, so
that a missing package fails there; elsewhere (the main suite's .venv) the module is skipped.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FAST_COMPILE_OPTIONS, make_tp_mesh
from hf_checkpoint import TinyModel, tiny_model, write_checkpoint
from k3_tail.models.kimi_k3 import layer as layer_module, mxfp4
from k3_tail.models.kimi_k3.checkpoint import EXPERT_WEIGHTS, layer_config_from_hf, load_layer
from k3_tail.models.kimi_k3.parameters import ROUTED_EXPERT_SCALES

REQUIRE_VARIABLE = "K3_TAIL_REQUIRE_COMPRESSED_TENSORS"
if os.environ.get(REQUIRE_VARIABLE):
    import compressed_tensors  # noqa: F401  (where it is required, a missing package is an error, not a skip)
else:
    pytest.importorskip("compressed_tensors", reason=f"needs compressed-tensors (and torch): .ci/run's "
                                                     f".venv-compressed-tensors runs these, with {REQUIRE_VARIABLE}=1")
import torch  # noqa: E402  (compressed-tensors' own dependency)
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp  # noqa: E402

pytestmark = pytest.mark.compressed_tensors

MODEL = TinyModel(hidden_size=16, latent_size=128, expert_width=64)
TP_SIZE, LAYER = 2, 1
MOE = f"model.layers.{LAYER}.block_sparse_moe."
BFLOAT16 = np.dtype(jnp.bfloat16)
# The Linear modules left in bf16: Kimi-K3 quantises its routed experts only.
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*mlp.*", "re:.*shared_experts.*", r"re:.*block_sparse_moe\.gate$",
          r"re:.*routed_expert_(down|up)_proj$"]
# Each expert tensor's binades: every group of 32 input columns under 2^e, e in [LOW, HIGH), times 1/sqrt(in).
LOW_EXPONENT, HIGH_EXPONENT = -8, 3
# The largest magnitude of the one group per tensor near bf16's smallest normal (2^-126): scale 2^-127 or 2^-126.
TINY = 2.0 ** -124
layer_forward = jax.jit(layer_module.layer_forward, static_argnames=("config", "mesh", "axis_name", "weight_layout",
                                                                      "tier"), compiler_options=FAST_COMPILE_OPTIONS)
decode = jax.jit(mxfp4.decode, static_argnames="dtype")


def expert_weight(rng, out_features, in_features):
    """[out, in] bf16 weights spanning several binades per row (module docstring): normal values, each group of 32
    input columns under its own power of two; a tenth of them 0 (half of those -0), one group all 0 and one near
    bf16's smallest normal, in different rows."""
    groups = in_features // mxfp4.GROUP_SIZE
    binades = 2.0 ** rng.integers(LOW_EXPONENT, HIGH_EXPONENT, size=(out_features, groups))
    weight = rng.standard_normal((out_features, in_features)) * np.repeat(binades, mxfp4.GROUP_SIZE, axis=1)
    weight /= np.sqrt(in_features)
    zeros = rng.random(weight.shape) < 0.1
    weight[zeros] = np.where(rng.random(weight.shape) < 0.5, 0.0, -0.0)[zeros]
    zero_row, tiny_row = rng.choice(out_features, size=2, replace=False)
    zero_group, tiny_group = (slice(group * mxfp4.GROUP_SIZE, (group + 1) * mxfp4.GROUP_SIZE)
                              for group in rng.integers(groups, size=2))
    weight[zero_row, zero_group] = 0.0
    weight[tiny_row, tiny_group] = TINY * rng.uniform(-1.0, 1.0, mxfp4.GROUP_SIZE)
    return weight.astype(BFLOAT16)


def model_tensors(seed=5):
    """The tiny model's tensors (tests/hf_checkpoint.py), its routed experts' weights from :func:`expert_weight`."""
    tensors, rng = tiny_model(MODEL, seed=seed), np.random.default_rng(seed)
    for name, value in tensors.items():
        if ".experts." in name:
            tensors[name] = expert_weight(rng, *value.shape)
    return tensors


def to_torch(value):
    """A numpy array as a torch tensor of the same bits (bf16 through its 16-bit pattern: numpy has no bf16)."""
    if value.dtype == BFLOAT16:
        return torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(value.copy())


def to_numpy(tensor):
    """A torch tensor as a numpy array of the same bits (bf16 as ml_dtypes' bfloat16)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()


def linear_model(tensors):
    """A torch module holding each Linear weight of ``tensors`` (the 2-d ``...weight`` of the text model but the
    embedding) as an ``nn.Linear`` under the same dotted name, so that ``named_modules`` gives the checkpoint's
    names: what compressed-tensors quantises and compresses."""
    root = torch.nn.Module()
    for name, value in tensors.items():
        if value.ndim != 2 or not name.startswith(("model.layers.", "lm_head")):
            continue
        *path, leaf = name.removesuffix(".weight").split(".")
        parent = root
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, torch.nn.Module())
            parent = parent._modules[part]
        linear = torch.nn.Linear(value.shape[1], value.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight = torch.nn.Parameter(to_torch(value), requires_grad=False)
        parent.add_module(leaf, linear)
    return root


def compress(tensors):
    """(the compressed model's tensors, its decompressed tensors, the ModelCompressor) by compressed-tensors
    (module docstring); the tensors that are no Linear's as they are, in both."""
    model = linear_model(tensors)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("MXFP4A16", ["Linear"])},
                                ignore=IGNORE)
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        scale, zero_point = compute_dynamic_scales_and_zp(module.weight, scheme.weights, module)
        module.weight_scale.data.copy_(scale)
        module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressed = {name: to_numpy(value) for name, value in model.state_dict().items()}
    compressor.decompress_model(model)
    decompressed = {name: to_numpy(value) for name, value in model.state_dict().items()
                    if not name.endswith("weight_scale")}
    kept = {name: value for name, value in tensors.items() if name not in decompressed}
    return {**kept, **compressed}, {**kept, **decompressed}, compressor


TENSORS = model_tensors()
COMPRESSED, DECOMPRESSED, COMPRESSOR = compress(TENSORS)


def write_config(directory, config):
    """Write ``config`` as ``directory``'s config.json and let compressed-tensors add its quantization_config
    (``ModelCompressor.update_config``: at the top level, as for a text model). Returns what it added."""
    file = directory / "config.json"
    file.write_text(json.dumps(config))
    COMPRESSOR.update_config(str(directory))
    return json.loads(file.read_text())["quantization_config"]


def write_kimi_k3_config(directory):
    """Write the tiny model's config.json into ``directory`` with compressed-tensors' quantization_config
    (:func:`write_config`) moved under ``text_config``, where Kimi-K3 has it."""
    write_config(directory, MODEL.config())
    file = directory / "config.json"
    whole = json.loads(file.read_text())
    whole["text_config"]["quantization_config"] = whole.pop("quantization_config")
    file.write_text(json.dumps(whole, indent=2))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """(the checkpoint compressed-tensors wrote, the checkpoint of its decompressed bf16 weights)."""
    root = tmp_path_factory.mktemp("compressed_tensors")
    compressed = write_checkpoint(root / "mxfp4", COMPRESSED)
    write_kimi_k3_config(compressed)
    return compressed, write_checkpoint(root / "bf16", DECOMPRESSED, config=MODEL.config())


@pytest.fixture(scope="module")
def layers(paths):
    """(the layer loaded from compressed-tensors' checkpoint, the layer loaded from the decompressed one), on p = 2."""
    mesh = make_tp_mesh(TP_SIZE)
    return tuple(load_layer(path, LAYER, config=layer_config_from_hf(path), mesh=mesh) for path in paths)


def bits(values):
    """The bit patterns of a bf16 or float32 array (so -0 differs from 0 and NaNs compare)."""
    values = np.asarray(values)
    return values.view({2: np.uint16, 4: np.uint32}[values.dtype.itemsize])


# --- What compressed-tensors writes -------------------------------------------------------------------------------


def test_compressed_tensors_stores_each_routed_expert_as_kimi_k3_does_and_the_rest_as_it_was():
    """Every expert's w1, w2, w3 [out, in] as weight_packed uint8 [out, in/2] and weight_scale uint8 [out, in/32],
    no weight; every other tensor bit for bit the model's."""
    experts = {name for name in TENSORS if ".experts." in name}
    assert experts and not experts & set(COMPRESSED)
    for name in experts:
        out_features, in_features = TENSORS[name].shape
        stem = name.removesuffix(".weight")
        assert {suffix: (COMPRESSED[f"{stem}.{suffix}"].shape, COMPRESSED[f"{stem}.{suffix}"].dtype)
                for suffix in (mxfp4.PACKED, mxfp4.SCALE)} == {
            mxfp4.PACKED: ((out_features, in_features // 2), np.uint8),
            mxfp4.SCALE: ((out_features, in_features // mxfp4.GROUP_SIZE), np.uint8)}
    rest = set(TENSORS) - experts
    assert set(COMPRESSED) == rest | {f"{name.removesuffix('.weight')}.{suffix}" for name in experts
                                      for suffix in (mxfp4.PACKED, mxfp4.SCALE)}
    for name in rest:
        assert COMPRESSED[name].dtype == TENSORS[name].dtype and COMPRESSED[name].tobytes() == TENSORS[name].tobytes()


def test_the_scales_differ_between_the_groups_of_a_row_and_reach_u_0_but_never_255():
    """The fixture's premise: in every tensor rows whose groups have different scales, u = 0 (the all-zero and the
    tiny groups), the binades' spread; no u = 255 nor a scale the loader refuses (253, 254)."""
    for name, scales in COMPRESSED.items():
        if name.endswith(mxfp4.SCALE):
            assert (scales.max(axis=-1) > scales.min(axis=-1)).mean() > 0.8, name
            assert 0 in scales and scales.max() - np.median(scales) >= 2, name
            assert not np.isin(scales, (*mxfp4.OVERFLOWING_SCALES, mxfp4.NAN_SCALE)).any(), name


def test_compressed_tensors_quantization_config_under_text_config_makes_the_layer_hold_mxfp4_experts(paths):
    assert layer_config_from_hf(paths[0]).expert_quantization == "mxfp4"
    assert layer_config_from_hf(paths[1]).expert_quantization is None


def test_compressed_tensors_quantization_config_at_the_top_of_a_text_models_config_makes_it_mxfp4_too(tmp_path):
    """A model without Kimi-K3's wrapper: its config.json is the text config, where update_config writes."""
    quantization = write_config(tmp_path, MODEL.text_config())
    assert (quantization["quant_method"], quantization["format"]) == (mxfp4.QUANT_METHOD, mxfp4.FORMAT)
    assert layer_config_from_hf(tmp_path).expert_quantization == "mxfp4"


def test_compressed_tensors_quantization_config_at_the_top_of_a_wrapper_makes_the_layer_hold_mxfp4_experts(tmp_path):
    """Kimi-K3's layout as update_config leaves it: the quantization_config beside text_config, not inside."""
    checkpoint = write_checkpoint(tmp_path / "mxfp4", COMPRESSED)
    write_config(checkpoint, MODEL.config())
    config = layer_config_from_hf(checkpoint)
    assert config.expert_quantization == "mxfp4"
    assert load_layer(checkpoint, LAYER, config=config, mesh=make_tp_mesh(TP_SIZE)) is not None


# --- The loaded layer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", mxfp4.DECODED_DTYPES, ids=lambda dtype: dtype.name)
def test_the_loaded_experts_decode_bit_for_bit_to_compressed_tensors_decompressed_weights(layers, dtype):
    """compressed-tensors decompresses to bf16, where every MXFP4 value is exact (subnormals included): in float32
    its values are those bf16 values converted."""
    values = layers[0].parameter_values()
    for name, weight in EXPERT_WEIGHTS:
        decompressed = np.stack([DECOMPRESSED[f"{MOE}experts.{expert}.{weight}.weight"].T
                                 for expert in range(MODEL.num_experts)]).astype(dtype)
        decoded = np.asarray(decode(values[name], values[ROUTED_EXPERT_SCALES[name]], dtype=dtype))
        assert decoded.dtype == dtype and decoded.shape == decompressed.shape
        np.testing.assert_array_equal(bits(decoded), bits(decompressed), err_msg=name)


@pytest.mark.parametrize(("method", "num_tokens"), [("gather", 1), ("capacity", 4), ("ragged_dot", 4)])
def test_the_layer_from_compressed_tensors_checkpoint_computes_bit_for_bit_what_the_decompressed_bf16_layer_does(
        layers, method, num_tokens):
    """Each routed-expert method, both layers computing in bf16 products (the MXFP4 one decodes its experts to the
    layer's bf16 first)."""
    assert [layer.config.expert_quantization for layer in layers] == ["mxfp4", None]
    x = jnp.asarray(np.random.default_rng(num_tokens).standard_normal((num_tokens, MODEL.hidden_size)), jnp.bfloat16)
    quantized, dense = (layer_forward(layer.parameter_values(), x, mesh=layer.mesh,
                                      config=dataclasses.replace(layer.config, routed_experts=method))
                        for layer in layers)
    assert np.isfinite(np.asarray(dense, np.float32)).all() and np.asarray(dense, np.float32).any()
    np.testing.assert_array_equal(bits(quantized), bits(dense))
