"""MXFP4 routed experts (k3_tail/models/kimi_k3/mxfp4.py, k3_tail/models/kimi_k3/mxfp4_experts.py, and their loading in
k3_tail/models/kimi_k3/checkpoint.py).

The decoder against an independent one (tests/mxfp4_fixture.py: ml_dtypes' float4_e2m1fn on each nibble and
float8_e8m0fnu on each scale, in float64) on every byte value, so all 16 codes in both nibbles, under scales at
both ends of E8M0's range and its NaN; where the format's dtypes alone are exact on the CPU (all but the
subnormal products XLA:CPU flushes) and that a GPU program uses nothing else. A tiny model in Kimi-K3's layout
(tests/hf_checkpoint.py: H 16, L 64, 4 experts of width m = 64, top 2, on p = 2 CPU devices: each rank holds one
group of 32 of w2's input columns) written twice with safetensors' writer: its routed experts as
compressed-tensors' MXFP4 (encoded by the fixture), and as the bf16 ``weight`` tensors those bytes decode to.
The MXFP4 layer holds its experts packed, each rank reading only its bytes, and computes bit for bit what the
bf16 layer computes.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
import mxfp4_fixture
from helpers import FAST_COMPILE_OPTIONS, gpu_mesh_for, make_tp_mesh, topology_params
from hf_checkpoint import TinyModel, record_reads, tiny_model, write_checkpoint
from k3_tail.models.kimi_k3 import (
    LayerConfig,
    layer as layer_module,
    layer_parameters,
    mxfp4,
    mxfp4_experts as kimi_k3_mxfp4,
    partition_specs,
    random_checkpoint,
)
from k3_tail.models.kimi_k3.checkpoint import layer_config_from_hf, load_layer
from k3_tail.models.kimi_k3.mxfp4 import MXFP4_BYTES
from k3_tail.models.kimi_k3.parameters import ROUTED_EXPERT_SCALES, ROUTED_EXPERT_WEIGHTS

MODEL = TinyModel(hidden_size=16, latent_size=64, expert_width=64)
TP_SIZE, LAYER = 2, 1
MOE = f"model.layers.{LAYER}.block_sparse_moe."
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
                                  "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                                              "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.*"],
}
# Scales at both ends of E8M0's range (2^-127, a subnormal, and 2^127), around 1, and NaN.
SCALES = (0, 1, 2, 126, 127, 128, 253, 254, 255)
layer_forward = jax.jit(layer_module.layer_forward, static_argnames=("config", "mesh", "axis_name", "weight_layout",
                                                                      "tier"), compiler_options=FAST_COMPILE_OPTIONS)
decode = jax.jit(mxfp4.decode, static_argnames="dtype")


def mxfp4_config(quantization=QUANTIZATION_CONFIG):
    whole = MODEL.config()
    return {**whole, "text_config": {**whole["text_config"], "quantization_config": quantization}}


def checkpoints_of(tensors):
    """(MXFP4 tensors, bf16 tensors): every routed expert's weight encoded (weight_packed, weight_scale), and
    in the other the bf16 weight those bytes decode to; everything else the same."""
    quantized, decoded = {}, {}
    for name, value in tensors.items():
        if ".experts." not in name:
            quantized[name] = decoded[name] = value
            continue
        stem = name.removesuffix(".weight")
        packed, scale = mxfp4_fixture.encode(value)
        quantized[f"{stem}.weight_packed"], quantized[f"{stem}.weight_scale"] = packed, scale
        decoded[name] = mxfp4_fixture.decode(packed, scale).astype(jnp.bfloat16)
    return quantized, decoded


QUANTIZED, DECODED = checkpoints_of(tiny_model(MODEL, seed=3))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    return (write_checkpoint(root / "mxfp4", QUANTIZED, config=mxfp4_config()),
            write_checkpoint(root / "bf16", DECODED, config=MODEL.config()))


@pytest.fixture(scope="module")
def layers(paths):
    """(the layer loaded from the MXFP4 checkpoint, the layer loaded from the bf16 one), on p = 2."""
    mesh = make_tp_mesh(TP_SIZE)
    return tuple(load_layer(path, LAYER, config=layer_config_from_hf(path), mesh=mesh) for path in paths)


# --- The decoder ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", mxfp4.DECODED_DTYPES, ids=lambda dtype: dtype.name)
def test_decoding_matches_ml_dtypes_on_every_code_in_both_nibbles_and_every_end_of_the_scale_range(dtype):
    """Packed [256, 9] (Flax layout: rows along K): byte b in row b of every column, so each code meets each in the
    other nibble; column j under the scale SCALES[j]. Exact: the reference's float64 values rounded to the dtype
    (finite ones are exact; 6 * 2^127 rounds to inf), NaN where u = 255, the sign of -0 kept."""
    packed = np.repeat(np.arange(256, dtype=np.uint8)[:, None], len(SCALES), axis=1)
    scale = np.repeat(np.array(SCALES, np.uint8)[None, :], 256 * 2 // mxfp4.GROUP_SIZE, axis=0)
    with np.errstate(over="ignore"):
        expected = mxfp4_fixture.decode(packed.T, scale.T).T.astype(dtype)
    decoded = np.asarray(decode(packed, scale, dtype=dtype))
    assert decoded.dtype == dtype and decoded.shape == (512, len(SCALES))
    np.testing.assert_array_equal(decoded.astype(np.float64), expected.astype(np.float64))
    assert np.array_equal(np.signbit(decoded), np.signbit(expected))
    assert np.isnan(decoded[:, SCALES.index(255)]).all()
    assert decoded[2, SCALES.index(0)] == 2.0 ** -128  # the low nibble of byte 1: code 1, 0.5 * 2^-127, subnormal


def test_the_low_nibble_is_the_even_input_column():
    packed = np.zeros((16, 1), np.uint8)  # one group of 32 rows
    packed[0, 0] = 0x72
    decoded = np.asarray(decode(packed, np.full((1, 1), 127, np.uint8), dtype=np.float32))
    assert decoded[:3, 0].tolist() == [1.0, 6.0, 0.0]  # code 2 (1.0) in row 0, code 7 (6.0) in row 1


# E8M0's subnormal 2^-127, its two smallest normals, 1, its largest and NaN, each under the 16 E2M1 codes.
EDGE_SCALES = np.array([0, 1, 2, 127, 254, 255], np.uint8)
CODES = np.arange(16, dtype=np.uint8)
# The (code, u) whose product XLA:CPU flushes to +-0: every nonzero code under u = 0 (2^-127 is a subnormal
# operand) and +-0.5 under u = 1 (0.5 * 2^-126 = 2^-127, a subnormal result).
FLUSHED = {(code, 0) for code in range(16) if code & 7} | {(1, 1), (9, 1)}


def misses(actual, expected):
    """The (code, u) of a [CODES, EDGE_SCALES] table where ``actual`` is not ``expected``: another value, a NaN
    against a number, or the other sign bit."""
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    same = ((a == e) | (np.isnan(a) & np.isnan(e))) & (np.signbit(a) == np.signbit(e))
    return {(int(CODES[i]), int(EDGE_SCALES[j])) for i, j in np.argwhere(~same)}


def test_xla_cpu_converts_the_formats_dtypes_exactly_subnormal_scale_and_nan_included():
    """So what XLA:CPU flushes in the dtype route is the multiply, not the conversions."""
    values = jax.jit(lambda codes: codes.astype(jnp.uint4).view(jnp.float4_e2m1fn).astype(jnp.float32))(CODES)
    scales = jax.jit(lambda scales: scales.view(jnp.float8_e8m0fnu).astype(jnp.float32))(EDGE_SCALES)
    np.testing.assert_array_equal(np.asarray(values), CODES.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.signbit(np.asarray(values)).tolist() == [code >= 8 for code in range(16)]
    assert np.asarray(scales, np.float64).tolist()[:5] == [2.0 ** -127, 2.0 ** -126, 2.0 ** -125, 1.0, 2.0 ** 127]
    assert np.isnan(np.asarray(scales)[5])


@pytest.mark.parametrize("dtype", mxfp4.DECODED_DTYPES, ids=lambda dtype: dtype.name)
def test_on_the_cpu_the_hand_built_bits_are_needed_exactly_where_the_dtype_route_flushes(dtype):
    """Every code under each edge scale against ml_dtypes (float64 rounded to the dtype: 6 * 2^127 is inf). The
    dtype route (``values_by_dtypes``) misses FLUSHED alone, where it gives +-0; the decoder, which on the CPU
    builds the values under u <= 1 from their bits, misses nothing."""
    with np.errstate(over="ignore"):
        expected = mxfp4_fixture.values(CODES[:, None], EDGE_SCALES[None, :]).astype(dtype)
    values = CODES.view(ml_dtypes.float4_e2m1fn)[:, None]
    route = np.asarray(jax.jit(mxfp4.values_by_dtypes)(values, EDGE_SCALES[None, :])).astype(dtype)
    assert misses(route, expected) == FLUSHED
    assert [float(route[code, list(EDGE_SCALES).index(u)]) for code, u in sorted(FLUSHED)] == [0.0] * len(FLUSHED)
    packed = np.repeat((CODES | CODES << 4)[:, None], len(EDGE_SCALES), axis=1)  # one group: code c in rows 2c, 2c + 1
    decoded = np.asarray(decode(packed, EDGE_SCALES[None, :], dtype=dtype))[::2]
    assert misses(decoded, expected) == set()


@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8", "mi355xx8"))
def test_a_gpu_program_decodes_through_the_formats_dtypes_alone(topology):
    """Compiled for a deviceless GPU topology, the decoder converts float4_e2m1fn codes and float8_e8m0fnu scales
    and multiplies them, with no select: the hand-built bits are the CPU program's only."""
    replicated = NamedSharding(gpu_mesh_for(topology), P())
    packed, scale = (jax.ShapeDtypeStruct(shape, jnp.uint8, sharding=replicated) for shape in ((16, 8), (1, 8)))
    hlo = decode.lower(packed, scale, dtype=jnp.bfloat16).compile().as_text()
    assert "f4e2m1fn" in hlo and "f8e8m0fnu" in hlo
    assert " select(" not in hlo


def test_only_the_groups_past_float32s_largest_finite_overflow():
    """u = 254 (2^127) with a code of 2 or more; u = 253 with 4 or more; never u = 255 (NaN) or below 253."""
    codes = {"1.5": 0x3, "2": 0x4, "4": 0x6}
    packed = np.array([[codes[c]] for c in ("1.5", "2", "4")], np.uint8).repeat(16, axis=1).T  # [16, 3]
    for u, expected in ((252, [0, 0, 0]), (253, [0, 0, 1]), (254, [0, 1, 1]), (255, [0, 0, 0])):
        scale = np.full((1, 3), u, np.uint8)
        assert mxfp4.overflowing_groups(packed, scale).tolist() == [[bool(e) for e in expected]], u


# --- The layer from an MXFP4 checkpoint -------------------------------------------------------------------------


def test_the_models_quantization_config_makes_the_layer_hold_mxfp4_experts(paths):
    assert layer_config_from_hf(paths[0]).expert_quantization == "mxfp4"
    assert layer_config_from_hf(paths[1]).expert_quantization is None


def test_a_wrappers_top_level_quantization_config_serves_a_text_config_without_one():
    # Where compressed-tensors' ModelCompressor.update_config writes it; the text config's own comes first.
    assert layer_config_from_hf({**MODEL.config(), "quantization_config": QUANTIZATION_CONFIG}).expert_quantization \
        == "mxfp4"
    with pytest.raises(ValueError, match=r"^quantization_config\.format: this layer loads"):
        layer_config_from_hf({**MODEL.config(), "quantization_config": {**QUANTIZATION_CONFIG, "format": "nvfp4"}})
    assert layer_config_from_hf({**mxfp4_config(), "quantization_config": {"quant_method": "fp8"}}
                                ).expert_quantization == "mxfp4"


def test_the_experts_stay_packed_in_the_layers_layout_and_decode_to_the_bf16_layers(layers):
    quantized, dense = (layer.parameter_values() for layer in layers)
    specs = partition_specs(layers[0].config, TP_SIZE)
    for name, scale_name in ROUTED_EXPERT_SCALES.items():
        packed, scale = quantized[name], quantized[scale_name]
        rows, columns = dense[name].shape[1:]
        assert packed.dtype == scale.dtype == jnp.uint8
        assert packed.shape == (MODEL.num_experts, rows // 2, columns)
        assert scale.shape == (MODEL.num_experts, rows // mxfp4.GROUP_SIZE, columns)
        assert packed.sharding.spec == scale.sharding.spec == specs[name] == dense[name].sharding.spec
        np.testing.assert_array_equal(np.asarray(decode(packed, scale, dtype=jnp.bfloat16)), np.asarray(dense[name]))
    assert set(quantized) == set(dense) | set(ROUTED_EXPERT_SCALES.values())


@pytest.mark.parametrize(("method", "num_tokens"), [("gather", 1), ("capacity", 4), ("ragged_dot", 4)])
def test_the_mxfp4_layer_computes_bit_for_bit_what_the_decoded_bf16_layer_computes(layers, method, num_tokens):
    """Each routed-expert method (gather and capacity where the layer picks them: T*k <= E and above)."""
    x = jnp.asarray(np.random.default_rng(num_tokens).standard_normal((num_tokens, MODEL.hidden_size)), jnp.bfloat16)
    quantized, dense = (layer_forward(layer.parameter_values(), x, mesh=layer.mesh,
                                      config=dataclasses.replace(layer.config, routed_experts=method))
                        for layer in layers)
    assert np.isfinite(np.asarray(dense, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(quantized), np.asarray(dense))


def test_each_rank_holds_0_53_bytes_per_expert_weight(layers):
    """One device's blocks of the three expert kernels (and their scales): 3 E L m/p weights at 1/2 + 1/32 bytes,
    against 2 bytes in bf16: what expert_bytes_per_rank gives for Kimi-K3 (module docstring's table)."""
    def expert_bytes(layer, names):
        values = layer.parameter_values()
        return sum(values[name].addressable_shards[0].data.nbytes for name in names)

    weights = ROUTED_EXPERT_WEIGHTS
    sizes = (MODEL.num_experts, MODEL.latent_size, MODEL.expert_width, TP_SIZE)
    quantized = expert_bytes(layers[0], (*weights, *ROUTED_EXPERT_SCALES.values()))
    assert quantized == kimi_k3_mxfp4.expert_bytes_per_rank(*sizes, MXFP4_BYTES) == 3 * 4 * 64 * 32 * 17 // 32
    assert expert_bytes(layers[1], weights) == kimi_k3_mxfp4.expert_bytes_per_rank(*sizes, 2)
    assert kimi_k3_mxfp4.expert_bytes_per_rank(896, 3584, 3072, 8, MXFP4_BYTES) == 1_965_293_568
    assert kimi_k3_mxfp4.expert_bytes_per_rank(896, 3584, 3072, 8, 2) == 7_398_752_256


# What each rank reads of one expert's stored tensors (m = L = 64, p = 2): (the axis the ranks split, the
# length of a rank's block along it, its bytes). w1 and w3 [m, L/2] and [m, L/32]: 32 rows each; w2 [L, m/2] and
# [L, m/32]: a rank's 32 input columns are 16 bytes and 1 scale of each of the 64 rows.
RANK_BLOCKS = {
    "w1": {"weight_packed": (0, 32, 32 * 32), "weight_scale": (0, 32, 32 * 2)},
    "w3": {"weight_packed": (0, 32, 32 * 32), "weight_scale": (0, 32, 32 * 2)},
    "w2": {"weight_packed": (1, 16, 64 * 16), "weight_scale": (1, 1, 64 * 1)},
}


def test_each_rank_reads_only_the_bytes_and_scales_of_its_slice(paths, monkeypatch):
    """Rank i reads block i of each tensor (RANK_BLOCKS), once."""
    reads = record_reads(monkeypatch)
    load_layer(paths[0], LAYER, config=layer_config_from_hf(paths[0]), mesh=make_tp_mesh(TP_SIZE))
    for expert in range(MODEL.num_experts):
        for weight, tensors in RANK_BLOCKS.items():
            for suffix, (axis, length, size) in tensors.items():
                name = f"language_model.{MOE}experts.{expert}.{weight}.{suffix}"
                blocks = sorted((index[axis].start, index[axis].stop, nbytes) for tensor, index, nbytes in reads
                                if tensor == name)
                assert blocks == [(rank * length, (rank + 1) * length, size) for rank in range(TP_SIZE)], name


def test_a_tp_size_whose_slices_split_a_group_is_refused_naming_the_tensor_the_slice_and_the_group(paths):
    """p = 4: each rank would hold 16 of w2's 64 input columns, half a group of 32."""
    message = (r"^layer 1: language_model\.model\.layers\.1\.block_sparse_moe\.experts\.0\.w2\.weight_scale "
               r"\(and every expert's w2\): with p = 4 each rank holds 16 of w2's 64 input columns "
               r"\(rank 1: columns \[16, 32\)\), not whole MXFP4 groups of 32 columns")
    with pytest.raises(ValueError, match=message):
        load_layer(paths[0], LAYER, config=layer_config_from_hf(paths[0]), mesh=make_tp_mesh(4))


def with_scale(tensor, row, group, scale, code=None):
    """QUANTIZED with one group of ``tensor`` (under experts.2.) under ``scale``, all its codes ``code`` if given."""
    name = f"{MOE}experts.2.{tensor}"
    packed, scales = QUANTIZED[f"{name}.weight_packed"].copy(), QUANTIZED[f"{name}.weight_scale"].copy()
    scales[row, group] = scale
    if code is not None:
        packed[row, group * 16:(group + 1) * 16] = code | code << 4
    return {**QUANTIZED, f"{name}.weight_packed": packed, f"{name}.weight_scale": scales}


def test_a_group_past_bf16s_range_is_refused_naming_the_tensor_and_the_group(tmp_path):
    path = write_checkpoint(tmp_path, with_scale("w3", row=5, group=1, scale=254, code=0x7), config=mxfp4_config())
    message = (r"^layer 1: language_model\..*experts\.2\.w3\.weight_scale: row 5, input columns \[32, 64\): the scale "
               r"2\^127 makes values past bfloat16's largest finite")
    with pytest.raises(ValueError, match=message):
        load_layer(path, LAYER, config=layer_config_from_hf(path), mesh=make_tp_mesh(TP_SIZE))


def test_a_nan_scale_loads_as_nan_weights_in_its_group_only(tmp_path):
    path = write_checkpoint(tmp_path, with_scale("w2", row=3, group=1, scale=255), config=mxfp4_config())
    values = load_layer(path, LAYER, config=layer_config_from_hf(path), mesh=make_tp_mesh(TP_SIZE)).parameter_values()
    down = np.asarray(decode(values["expert_down"], values["expert_down_scale"], dtype=jnp.bfloat16), np.float32)
    nan = np.zeros(down.shape, bool)
    nan[2, 32:64, 3] = True  # w2 [L, m] row 3, input columns 32..63 -> expert_down[2] [m, L] rows 32..63, column 3
    assert np.array_equal(np.isnan(down), nan)


# --- What is refused ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "field"), [
    ({"format": "nvfp4-pack-quantized"}, r"text_config\.quantization_config\.format"),
    ({"quant_method": "fp8"}, r"text_config\.quantization_config\.quant_method"),
    ({"config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}},
     r"text_config\.quantization_config\.config_groups\.group_0\.weights\.group_size"),
    ({"config_groups": {"group_0": {"input_activations": {"num_bits": 4, "type": "float"}}}},
     r"text_config\.quantization_config\.config_groups\.group_0\.input_activations"),
], ids=["nvfp4", "fp8", "group-16", "w4a4"])
def test_another_quantisation_is_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=rf"^{field}: this layer loads compressed-tensors' 'mxfp4-pack-quantized'"):
        layer_config_from_hf(mxfp4_config({**QUANTIZATION_CONFIG, **change}))


def test_bf16_experts_under_an_mxfp4_config_are_refused(paths):
    config = layer_config_from_hf(paths[0])
    message = (r"^layer 1: the routed experts hold tensors that are not mxfp4-pack-quantized's weight_packed and "
               r"weight_scale \(language_model\..*experts\.0\.w1\.weight")
    with pytest.raises(ValueError, match=message):
        load_layer(paths[1], LAYER, config=config, mesh=make_tp_mesh(TP_SIZE))


def small_config(**changes):
    tail = k3_tail.TailConfig(hidden_size=16, latent_size=changes.pop("latent_size", 64),
                              dtype=changes.pop("dtype", jnp.bfloat16))
    return LayerConfig(tail, num_experts=4, expert_intermediate_size=64, shared_intermediate_size=32,
                       **{"expert_quantization": "mxfp4", **changes})


@pytest.mark.parametrize(("build", "message"), [
    (lambda: small_config(expert_quantization="int4"), r"^expert_quantization: expected one of \(None, 'mxfp4'\)"),
    (lambda: small_config(dtype=jnp.float16), r"^tail: MXFP4 experts decode to \('bfloat16', 'float32'\), got "
                                              r"dtype float16"),
    (lambda: small_config(latent_size=48), r"^latent_size: MXFP4 experts need a multiple of 32"),
    (lambda: partition_specs(small_config(), 4),
     r"^expert_intermediate_size: MXFP4 experts split over 4 ranks need a multiple of 32 x 4 = 128"),
    (lambda: layer_module.KimiK3MoELayer(small_config(), make_tp_mesh(2), {
        **random_checkpoint(small_config()), "expert_up": np.zeros((4, 32, 64), np.float32)}),
     r"^checkpoint: expected expert_up of uint8 \(MXFP4 codes or scales\), got float32"),
    (lambda: mxfp4.decode(jnp.zeros((16, 2), jnp.uint8), jnp.zeros((1, 2), jnp.uint8), jnp.float16),
     r"^dtype: MXFP4 decodes to one of"),
    (lambda: mxfp4.decode(jnp.zeros((16, 2), jnp.uint8), jnp.zeros((2, 2), jnp.uint8), jnp.bfloat16),
     r"^scale: expected shape \(1, 2\)"),
    (lambda: mxfp4.decode([[0] * 2] * 16, jnp.zeros((1, 2), jnp.uint8), jnp.bfloat16),
     r"^packed: expected a uint8 array .*, got a list"),
    (lambda: mxfp4.decode(jnp.zeros((16, 2), jnp.uint8), jnp.zeros((1, 2), jnp.uint8), None),
     r"^dtype: MXFP4 decodes to one of .*, got None"),
    (lambda: mxfp4.overflowing_groups(np.zeros((15, 2), np.uint8), np.full((1, 2), 254, np.uint8)),
     r"^packed: expected K/2 byte rows .* a multiple of 16"),
], ids=["unknown-quantization", "float16", "latent-size", "tp-size", "float-codes", "decode-dtype", "scale-shape",
        "decode-list", "decode-no-dtype", "overflow-check-malformed"])
def test_bad_input_is_a_value_error_naming_it(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_stand_in_mxfp4_experts_are_valid_codes_of_about_the_kernels_spread():
    """random_checkpoint for an MXFP4 config: every parameter of its shape and dtype, the codes uniform and one
    scale per kernel, decoding to a spread within a factor sqrt(2) of the bf16 stand-ins' (a power of two)."""
    config = small_config()
    weights, parameters = random_checkpoint(config), layer_parameters(config)
    assert {name: (value.shape, value.dtype) for name, value in weights.items()} == {
        name: (p.shape, p.dtype) for name, p in parameters.items()}
    for name, scale_name in ROUTED_EXPERT_SCALES.items():
        stored = (weights[name].swapaxes(-1, -2), weights[scale_name].swapaxes(-1, -2))  # torch's [out, in]
        spread = float(np.std(mxfp4_fixture.decode(*stored)))
        assert parameters[name].stddev / 2 ** 0.5 <= spread <= parameters[name].stddev * 2 ** 0.5, name


def gpu_device(kind, platform):
    """A stand-in ``jax.Device`` of a GPU of ``kind`` on ``platform`` ("rocm" or "cuda"), as a PJRT client shows it."""
    return types.SimpleNamespace(platform="gpu", device_kind=kind, client=types.SimpleNamespace(_raw_platform=platform))


GPUS = [("AMD Instinct MI355X", "rocm"), ("AMD MI300X", "rocm"), ("NVIDIA H100 80GB HBM3", "cuda")]


@pytest.mark.parametrize("method", ["gather", "ragged_dot"])
def test_decode_and_ragged_dot_decode_with_xla_on_every_device(method):
    for device in (jax.devices("cpu")[0], *(gpu_device(*gpu) for gpu in GPUS)):
        assert kimi_k3_mxfp4.mxfp4_path(method, device).decode == kimi_k3_mxfp4.DECODE_PATHS[method]


def test_the_capacity_gemms_decode_in_the_kernels_operand_load_on_a_gpu_and_with_xla_on_the_cpu():
    for gpu in GPUS:
        assert kimi_k3_mxfp4.mxfp4_path("capacity", gpu_device(*gpu)).decode == kimi_k3_mxfp4.IN_KERNEL_PATH
    assert kimi_k3_mxfp4.mxfp4_path("capacity", jax.devices("cpu")[0]).decode == kimi_k3_mxfp4.DECODE_PATHS[
        "capacity"]


@pytest.mark.parametrize(("kind", "platform", "says", "not_said"), [
    ("AMD Instinct MI355X", "rocm", "activations are bf16", "HBM"),
    ("AMD MI300X", "rocm", "3.81 GB a layer per rank at p = 8, 351 GB for Kimi-K3's 92 MoE layers, against 192 GB",
     "activations"),
    ("NVIDIA H100 80GB HBM3", "cuda", "1.94x the packed bytes", "gfx"),
])
def test_the_reason_names_what_stops_another_route_on_that_gpu_only(kind, platform, says, not_said):
    reason = kimi_k3_mxfp4.mxfp4_path("capacity", gpu_device(kind, platform)).reason
    assert says in reason and not_said not in reason


def test_the_reason_on_mi300x_sizes_the_fp8_copy_by_the_tp_size():
    assert "7.63 GB a layer per rank at p = 4" in kimi_k3_mxfp4.mxfp4_path(
        "gather", gpu_device("AMD MI300X", "rocm"), tp_size=4).reason


@pytest.mark.parametrize(("activation_format", "percent"), [(None, 0.17), ("mxfp8", 2.97), ("mxfp4", 11.42)])
def test_quantising_the_activations_costs_what_the_guide_says(activation_format, percent):
    error = kimi_k3_mxfp4.activation_quantization_error(activation_format)
    assert round(100 * error, 2) == percent


def test_an_unknown_method_or_activation_format_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="activation_format: expected None or one of"):
        kimi_k3_mxfp4.activation_quantization_error("int8")
    with pytest.raises(ValueError, match="method: expected one of"):
        kimi_k3_mxfp4.mxfp4_path("dense", jax.devices("cpu")[0])
