"""FP8 up-projection weights: quantisation, the config, what the entry points accept, the module.

The tiers' parity with FP8 kernels (every tier, layout, p and T class, with and without FP8
activations) is in the covering design of tests/test_tiers.py; the compiled GPU programs in
tests/test_schedule.py; the cost model's counts in tests/test_cost_model.py; which format a device
multiplies, and the refusal of FP8 activations in the other one, in tests/test_rocm_gemms.py.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from helpers import make_tp_mesh
from k3_tail.ops.up_projection import TRANSPOSED_HINT, WHOLE_KERNEL_HINT, check_up_proj_kernel
from reference import FP8_ACTIVATIONS_TOLERANCE, TOLERANCE, kernel_matrix, make_inputs, reference_tail, relative_error

FORMATS = k3_tail.ops.up_projection.FP8_FORMATS
LARGEST = {name: float(jnp.finfo(name).max) for name in FORMATS}  # 448 (E4M3FN), 240 (E4M3FNUZ)
CONFIG = k3_tail.TailConfig(hidden_size=97, latent_size=64, dtype=jnp.float32)


def random_kernel(shape=(64, 97), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / np.sqrt(shape[0])


# --- quantize_up_proj -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_values_are_fp8_and_scales_are_the_column_amax_over_the_formats_largest_value(name):
    kernel = random_kernel()
    quantized = k3_tail.quantize_up_proj(kernel, name)
    assert quantized.values.dtype == jnp.dtype(name) and quantized.values.shape == kernel.shape
    assert quantized.scale.dtype == jnp.float32 and quantized.scale.shape == (kernel.shape[1],)
    np.testing.assert_allclose(quantized.scale, np.abs(kernel).max(axis=0) / LARGEST[name], rtol=1e-6)


@pytest.mark.parametrize("name", FORMATS)
def test_dequantized_values_are_within_half_an_fp8_unit_of_the_kernel(name):
    """3 mantissa bits: each value is off by at most 2^-4 of itself, or half the subnormal spacing."""
    kernel = random_kernel()
    quantized = k3_tail.quantize_up_proj(kernel, name)
    scale = np.asarray(quantized.scale, np.float64)
    error = np.abs(kernel_matrix(quantized) - kernel)
    finfo = jnp.finfo(name)
    bound = np.maximum(2.0 ** -4 * np.abs(kernel), float(finfo.smallest_subnormal) / 2 * scale)
    assert np.all(error <= bound * (1 + 1e-6))
    np.testing.assert_allclose(quantized.dequantize(), kernel_matrix(quantized), rtol=1e-6)


def test_a_loud_column_does_not_cost_the_others_their_precision():
    kernel = random_kernel()
    loud = kernel.copy()
    loud[:, 3] *= 1e4
    quiet, with_loud = (k3_tail.quantize_up_proj(k, "float8_e4m3fn") for k in (kernel, loud))
    others = np.arange(kernel.shape[1]) != 3
    np.testing.assert_array_equal(kernel_matrix(quiet)[:, others], kernel_matrix(with_loud)[:, others])


@pytest.mark.parametrize("name", FORMATS)
def test_huge_tiny_and_zero_columns_quantise_without_nan(name):
    """E4M3FNUZ has no infinity: a cast beyond its range is NaN, so values are clipped before the cast."""
    kernel = random_kernel((8, 4))
    kernel[:, 0] *= 1945.0 * 1e20
    kernel[:, 1] *= 1e-30
    kernel[:, 2] = 0.0
    quantized = k3_tail.quantize_up_proj(kernel, name)
    values = np.asarray(quantized.values, np.float32)
    assert np.isfinite(values).all() and np.isfinite(quantized.scale).all()
    assert np.abs(values).max(axis=0)[[0, 1, 3]] == pytest.approx(LARGEST[name])
    assert (values[:, 2] == 0).all() and quantized.scale[2] == 1.0
    assert relative_error(kernel_matrix(quantized)[:, 0], kernel[:, 0]) < 2.0 ** -4


@pytest.mark.parametrize("spelling", ["float8_e4m3fn", jnp.float8_e4m3fn, np.dtype(jnp.float8_e4m3fn)])
def test_the_format_may_be_named_or_given_as_a_dtype(spelling):
    assert k3_tail.quantize_up_proj(random_kernel(), spelling).dtype == jnp.dtype(jnp.float8_e4m3fn)


def test_a_bf16_checkpoint_kernel_is_quantised_from_its_bf16_values():
    kernel = jnp.asarray(random_kernel(), jnp.bfloat16)
    quantized = k3_tail.quantize_up_proj(kernel, "float8_e4m3fnuz")
    expected = k3_tail.quantize_up_proj(np.asarray(kernel, np.float32), "float8_e4m3fnuz")
    np.testing.assert_array_equal(np.asarray(quantized.values, np.float32), np.asarray(expected.values, np.float32))


@pytest.mark.parametrize(
    "kernel, dtype, argument",
    [
        pytest.param(random_kernel(), "float8_e5m2", "dtype", id="unsupported-format"),
        pytest.param(random_kernel(), "bfloat16", "dtype", id="not-fp8"),
        pytest.param(random_kernel(), None, "dtype", id="no-format"),
        pytest.param(random_kernel()[0], "float8_e4m3fn", "kernel", id="1-d"),
        pytest.param(np.ones((4, 4), np.int32), "float8_e4m3fn", "kernel", id="integer"),
        pytest.param(np.full((4, 4), np.nan, np.float32), "float8_e4m3fn", "kernel", id="nan"),
        pytest.param(np.full((4, 4), np.inf, np.float32), "float8_e4m3fnuz", "kernel", id="infinity"),
    ],
)
def test_bad_arguments_are_value_errors_naming_the_argument(kernel, dtype, argument):
    with pytest.raises(ValueError, match=f"^{argument}: "):
        k3_tail.quantize_up_proj(kernel, dtype)


@pytest.mark.parametrize("device", ["rocm", "gpu", 0, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))],
                         ids=["rocm", "gpu", "int", "mesh"])
def test_a_device_that_is_no_jax_device_is_refused_naming_device(device):
    """"rocm" would otherwise read as a CPU and give E4M3FN, which MI300X does not multiply."""
    with pytest.raises(ValueError, match=r"^device: expected a jax.Device"):
        k3_tail.quantize_up_proj(random_kernel(), device=device)


def test_a_quantized_kernel_is_a_pytree_that_crosses_jit():
    quantized = k3_tail.quantize_up_proj(random_kernel(), "float8_e4m3fn")
    assert len(jax.tree.leaves(quantized)) == 2
    doubled = jax.jit(lambda q: dataclasses.replace(q, scale=2 * q.scale))(quantized)
    assert isinstance(doubled, k3_tail.QuantizedKernel)
    np.testing.assert_allclose(doubled.dequantize(), 2 * np.asarray(quantized.dequantize()), rtol=1e-6)


def test_quantising_inside_jit_works_on_traced_kernels():
    kernel = random_kernel()
    traced = jax.jit(lambda k: k3_tail.quantize_up_proj(k, "float8_e4m3fn"))(kernel)
    eager = k3_tail.quantize_up_proj(kernel, "float8_e4m3fn")
    np.testing.assert_array_equal(np.asarray(traced.values, np.float32), np.asarray(eager.values, np.float32))


# --- TailConfig -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["float8_e4m3fnuz", jnp.float8_e4m3fnuz])
def test_config_normalises_the_up_proj_dtype(spelling):
    config = k3_tail.TailConfig.kimi_k3(up_proj_dtype=spelling)
    assert config.up_proj_dtype == np.dtype(jnp.float8_e4m3fnuz)
    assert config == k3_tail.TailConfig.kimi_k3(up_proj_dtype="float8_e4m3fnuz")
    assert hash(config) == hash(k3_tail.TailConfig.kimi_k3(up_proj_dtype="float8_e4m3fnuz"))


def test_config_with_the_activation_dtype_as_up_proj_dtype_is_the_unquantised_config():
    assert k3_tail.TailConfig.kimi_k3(up_proj_dtype="bfloat16") == k3_tail.TailConfig.kimi_k3()


@pytest.mark.parametrize(
    "fields, argument",
    [
        pytest.param({"up_proj_dtype": "float8_e5m2"}, "up_proj_dtype", id="unsupported-format"),
        pytest.param({"up_proj_dtype": "float32"}, "up_proj_dtype", id="another-float"),
        pytest.param({"fp8_activations": True}, "fp8_activations", id="fp8-activations-without-fp8-weights"),
        pytest.param({"up_proj_dtype": "float8_e4m3fn", "fp8_activations": 1}, "fp8_activations", id="not-a-bool"),
    ],
)
def test_config_rejects_bad_up_projection_fields(fields, argument):
    with pytest.raises(ValueError, match=f"^{argument}: "):
        k3_tail.TailConfig.kimi_k3(**fields)


# --- What the entry points accept ---------------------------------------------------------------------------


def kernel_mismatches():
    plain = random_kernel()
    quantized = k3_tail.quantize_up_proj(plain, "float8_e4m3fn")
    fp8 = dataclasses.replace(CONFIG, up_proj_dtype="float8_e4m3fn")
    return [
        pytest.param(fp8, plain, r"QuantizedKernel .*got a float64 array of shape \(64, 97\)$",
                     id="plain-kernel-with-fp8-config"),
        pytest.param(CONFIG, quantized, "up_proj_dtype is None", id="quantized-kernel-without-fp8-config"),
        pytest.param(dataclasses.replace(fp8, up_proj_dtype="float8_e4m3fnuz"), quantized, "float8_e4m3fnuz",
                     id="other-format"),
        pytest.param(fp8, dataclasses.replace(quantized, scale=quantized.scale[:-1]), "scale", id="short-scale"),
        pytest.param(fp8, dataclasses.replace(quantized, scale=quantized.scale.astype(jnp.bfloat16)), "float32",
                     id="bf16-scale"),
        pytest.param(fp8, k3_tail.quantize_up_proj(plain[:, :-1], "float8_e4m3fn"), "shape", id="narrow-values"),
    ]


@pytest.mark.parametrize("config, kernel, message", kernel_mismatches())
def test_tail_forward_rejects_a_kernel_that_does_not_match_the_config(config, kernel, message):
    inputs = make_inputs(config, 2, 3)
    with pytest.raises(ValueError, match=f"^up_proj_kernel: .*{message}"):
        k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, kernel, config=config,
                             mesh=make_tp_mesh(2))


@pytest.mark.parametrize("shape, shapes, column_block, hint", [
    ((97, 64), [(64, 97)], False, TRANSPOSED_HINT),
    ((97, 64), [(64, 97), (64, 100)], False, TRANSPOSED_HINT),
    ((25, 64), [(64, 25)], True, TRANSPOSED_HINT),
    ((64, 97), [(64, 25)], True, WHOLE_KERNEL_HINT),
    ((64, 100), [(64, 25)], True, WHOLE_KERNEL_HINT),
    ((97, 64), [(64, 25)], True, f"{TRANSPOSED_HINT}; and {WHOLE_KERNEL_HINT}"),
    ((64, 98), [(64, 97)], False, None),
    ((64, 97), [(64, 97 * 4)], True, None),
], ids=["transposed", "transposed-padded-layout", "transposed-block", "whole-for-a-block", "padded-for-a-block",
        "torch-weight-for-a-block", "other", "narrower-than-a-block"])
def test_a_kernel_of_the_wrong_shape_names_the_likely_fix(shape, shapes, column_block, hint):
    with pytest.raises(ValueError) as error:
        check_up_proj_kernel(np.zeros(shape, np.float32), dtype=np.dtype(np.float32), up_proj_dtype=None,
                             shapes=shapes, sizes="L=64, H=97, p=4", column_block=column_block)
    assert str(error.value) == (f"up_proj_kernel: expected shape {' or '.join(map(str, shapes))} (L=64, H=97, p=4), "
                                f"got {shape}" + ("" if hint is None else f"; {hint}"))


def test_quantized_values_of_the_transposed_shape_name_the_transpose():
    kernel = k3_tail.quantize_up_proj(random_kernel().T, "float8_e4m3fn")
    with pytest.raises(ValueError, match=re.escape(f"got (97, 64); {TRANSPOSED_HINT}")):
        check_up_proj_kernel(kernel, dtype=np.dtype(np.float32), up_proj_dtype=np.dtype(jnp.float8_e4m3fn),
                             shapes=[(64, 97)], sizes="L=64, H=97")


@pytest.mark.parametrize("kernel", [np.zeros((0, 96), np.float32), np.zeros((64, 0), np.float32), [[1.0, 2.0]]],
                         ids=["no-rows", "no-columns", "list"])
def test_quantize_up_proj_refuses_an_empty_kernel_or_a_non_array(kernel):
    with pytest.raises(ValueError, match=r"^kernel: expected a non-empty 2-d float array \[L, H\], got a"):
        k3_tail.quantize_up_proj(kernel, "float8_e4m3fn")


def test_latent_moe_tail_rejects_a_plain_kernel_with_an_fp8_config():
    config = dataclasses.replace(CONFIG, up_proj_dtype="float8_e4m3fn")
    inputs = make_inputs(CONFIG, 2, 3)
    per_rank = jax.shard_map(
        lambda r, s, g, w: k3_tail.latent_moe_tail(r[0], s[0], g, w, config=config),
        mesh=make_tp_mesh(2, jax.sharding.AxisType.Auto), in_specs=(P("tp"), P("tp"), P(), P()), out_specs=P(),
    )
    with pytest.raises(ValueError, match="^up_proj_kernel: .*QuantizedKernel"):
        per_rank(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel)


@pytest.mark.parametrize("fp8_activations", [False, True])
def test_a_models_shard_map_passes_column_blocks_of_values_and_scales(fp8_activations):
    """In a caller's shard_map the kernel is QuantizedKernel(P(None, axis), P(axis)): blocks of both."""
    config = dataclasses.replace(CONFIG, up_proj_dtype="float8_e4m3fnuz", fp8_activations=fp8_activations)
    inputs = make_inputs(config, 8, 5)
    mesh = make_tp_mesh(8)
    width = k3_tail.padded_hidden_size(config.hidden_size, 8)
    padded = jax.tree.map(lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])]), inputs.kernel)
    spec = k3_tail.QuantizedKernel(P(None, "tp"), P("tp"))
    kernel = jax.device_put(padded, jax.tree.map(lambda s: NamedSharding(mesh, s), spec,
                                                 is_leaf=lambda x: isinstance(x, P)))
    place = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    y = jax.jit(jax.shard_map(
        lambda r, s, g, w: k3_tail.latent_moe_tail(r[0], s[0], g, w, config=config, weight_layout="column"),
        mesh=mesh, in_specs=(P("tp"), P("tp"), P(), spec), out_specs=P(),
    ))(place(inputs.routed, P("tp")), place(inputs.shared, P("tp")), place(inputs.norm_weight, P()), kernel)
    limit = FP8_ACTIVATIONS_TOLERANCE if fp8_activations else TOLERANCE[config.dtype]
    assert relative_error(y, reference_tail(config, inputs)) <= limit


def test_tail_arguments_describe_values_and_scales_sharded_alike():
    config = dataclasses.replace(CONFIG, up_proj_dtype="float8_e4m3fn")
    mesh = make_tp_mesh(8)
    kernel = k3_tail.xla.compilation.tail_arguments(config, mesh, 4, weight_layout="column")[-1]
    assert isinstance(kernel, k3_tail.QuantizedKernel)
    assert (kernel.values.shape, kernel.values.dtype) == ((64, 104), jnp.float8_e4m3fn)
    assert (kernel.scale.shape, kernel.scale.dtype) == ((104,), jnp.float32)
    assert kernel.values.sharding.spec == P(None, "tp") and kernel.scale.sharding.spec == P("tp")


# --- LatentMoETail ------------------------------------------------------------------------------------------


def parameter_bytes(module):
    return sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(module, nnx.Param)))


@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
def test_fp8_module_holds_fp8_values_and_column_scales_in_about_half_the_bytes(weight_layout):
    mesh = make_tp_mesh(8)
    bf16 = k3_tail.TailConfig(hidden_size=512, latent_size=256)
    fp8 = dataclasses.replace(bf16, up_proj_dtype="float8_e4m3fn")
    dense, quantized = (k3_tail.LatentMoETail(c, mesh, rngs=nnx.Rngs(0), weight_layout=weight_layout)
                        for c in (bf16, fp8))
    assert quantized.up_proj_kernel[...].dtype == jnp.float8_e4m3fn and dense.up_proj_scale is None
    assert quantized.up_proj_scale[...].sharding.spec == P("tp" if weight_layout == "column" else None)
    assert parameter_bytes(quantized) / parameter_bytes(dense) == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
def test_loading_a_bf16_checkpoint_kernel_quantises_it(weight_layout):
    config = k3_tail.TailConfig(hidden_size=90, latent_size=64, up_proj_dtype="float8_e4m3fnuz")
    module = k3_tail.LatentMoETail(config, make_tp_mesh(4), rngs=nnx.Rngs(0), weight_layout=weight_layout)
    checkpoint = jnp.asarray(random_kernel((64, 90)), jnp.bfloat16)
    module.load_up_proj(checkpoint)
    inputs = dataclasses.replace(make_inputs(config, 4, 6), norm_weight=np.ones(64, jnp.bfloat16),
                                 kernel=k3_tail.quantize_up_proj(checkpoint, "float8_e4m3fnuz"))
    y = module(inputs.routed, inputs.shared)
    assert relative_error(y, reference_tail(config, inputs)) <= TOLERANCE[config.dtype]
    assert np.asarray(module.up_proj_scale[...]).shape == (92 if weight_layout == "column" else 90,)


def test_loading_a_kernel_of_the_wrong_shape_or_dtype_names_the_kernel():
    module = k3_tail.LatentMoETail(CONFIG, make_tp_mesh(2), rngs=nnx.Rngs(0))
    for bad in (random_kernel((64, 96)), random_kernel().astype(np.float16)):
        with pytest.raises(ValueError, match="^kernel: "):
            module.load_up_proj(bad)
