"""The full Cartesian products behind the covering designs of test_tiers.py and test_sequence_parallel.py.

About 3540 cases (minutes on 2 cores), 720 of them with FP8 up-projection weights, 480 with a shared
output reduced before the tail and 720 with quantised sums: skipped by default,
run with ``pytest -m slow``. The default run covers every pair of these factors (tests/covering.py);
these products try every combination.
"""

import dataclasses

import jax.numpy as jnp
import pytest

import k3_tail
from helpers import (
    assert_column_tier_writes_only_its_own_block,
    make_tp_mesh,
    reduced_shared,
    tier_layouts,
    token_sharded_rows,
)
from reference import TOLERANCE, make_inputs, reference_tail, relative_error, tolerance

pytestmark = pytest.mark.slow

SMALL = k3_tail.TailConfig(hidden_size=96, latent_size=64)  # 96 divides by 1, 2, 4, 8
SMALL_ODD = dataclasses.replace(SMALL, hidden_size=99)  # 99 divides by none of 2, 4, 8
SIZES = [pytest.param(SMALL, id="H96"), pytest.param(SMALL_ODD, id="H99")]
DTYPES = [pytest.param(jnp.bfloat16, id="bf16"), pytest.param(jnp.float32, id="f32")]


def run_tail(config, inputs, tp_size, tier, weight_layout):
    return k3_tail.tail_forward(
        inputs.routed,
        inputs.shared,
        inputs.norm_weight if config.use_latent_norm else None,
        inputs.kernel,
        config=config,
        mesh=make_tp_mesh(tp_size),
        tier=tier,
        weight_layout=weight_layout,
    )


def assert_matches_reference(config, inputs, y):
    expected = reference_tail(config, inputs)
    assert y.shape == expected.shape and y.dtype == config.dtype
    if expected.size:
        assert relative_error(y, expected) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", SIZES)
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 16, 257, 1024])
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_every_tier_layout_p_t_h_and_dtype_matches_the_reference(tier, weight_layout, tp_size, num_tokens, base, dtype):
    config = dataclasses.replace(base, dtype=dtype)
    inputs = make_inputs(config, tp_size, num_tokens)
    assert_matches_reference(config, inputs, run_tail(config, inputs, tp_size, tier, weight_layout))


@pytest.mark.parametrize("fp8_activations", [False, True], ids=["weights", "activations"])
@pytest.mark.parametrize("up_proj_dtype", k3_tail.ops.up_projection.FP8_FORMATS)
@pytest.mark.parametrize("base", SIZES)
@pytest.mark.parametrize("num_tokens", [1, 16, 257])
@pytest.mark.parametrize("tp_size", [1, 2, 8])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_every_tier_layout_p_t_and_h_with_fp8_weights(tier, weight_layout, tp_size, num_tokens, base, up_proj_dtype,
                                                      fp8_activations):
    config = dataclasses.replace(base, up_proj_dtype=up_proj_dtype, fp8_activations=fp8_activations)
    inputs = make_inputs(config, tp_size, num_tokens)
    y = run_tail(config, inputs, tp_size, tier, weight_layout)
    assert y.shape == (num_tokens, config.hidden_size) and y.dtype == config.dtype
    assert relative_error(y, reference_tail(config, inputs)) <= tolerance(config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_latent_norm", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["scale1", "scale2"])
@pytest.mark.parametrize("base", SIZES)
@pytest.mark.parametrize("tp_size", [2, 8])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_every_tier_honours_every_scale_and_norm(tier, weight_layout, tp_size, base, scale, use_latent_norm, dtype):
    config = dataclasses.replace(base, routed_scaling_factor=scale, use_latent_norm=use_latent_norm, dtype=dtype)
    inputs = make_inputs(config, tp_size, 16)
    assert_matches_reference(config, inputs, run_tail(config, inputs, tp_size, tier, weight_layout))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", SIZES)
@pytest.mark.parametrize("num_tokens", [8, 16, 264])
@pytest.mark.parametrize("tp_size", [2, 8])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_every_tier_returns_token_sharded_output(tier, weight_layout, tp_size, num_tokens, base, dtype):
    config = dataclasses.replace(base, dtype=dtype, sequence_parallel=True)
    inputs = make_inputs(config, tp_size, num_tokens)
    y = run_tail(config, inputs, tp_size, tier, weight_layout)
    assert y.sharding.spec[0] == "tp"
    rows = token_sharded_rows(y, config, num_tokens, tp_size)
    assert relative_error(rows, reference_tail(config, inputs)) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize("num_tokens", [1, 5, 13])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_every_tier_pads_tokens_that_p_does_not_divide_and_keeps_them_sharded(tier, weight_layout, num_tokens):
    config = dataclasses.replace(SMALL_ODD, sequence_parallel=True)
    inputs = make_inputs(config, 8, num_tokens)
    rows = token_sharded_rows(run_tail(config, inputs, 8, tier, weight_layout), config, num_tokens, 8)
    assert relative_error(rows, reference_tail(config, inputs)) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated_output", "sp"])
@pytest.mark.parametrize("base", SIZES)
@pytest.mark.parametrize("num_tokens", [1, 5, 16, 65])
@pytest.mark.parametrize("tp_size", [1, 2, 8])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_every_tier_takes_a_reduced_shared_output(tier, weight_layout, tp_size, num_tokens, base, sequence_parallel):
    config = dataclasses.replace(base, dtype=jnp.bfloat16, shared_output_is_reduced=True,
                                 sequence_parallel=sequence_parallel)
    inputs = make_inputs(config, tp_size, num_tokens)
    y = run_tail(config, dataclasses.replace(inputs, shared=reduced_shared(config, inputs.shared)), tp_size, tier,
                 weight_layout)
    if sequence_parallel:
        y = token_sharded_rows(y, config, num_tokens, tp_size)
    else:
        assert y.shape == (num_tokens, config.hidden_size) and y.dtype == config.dtype
    assert relative_error(y, reference_tail(config, inputs)) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize("weight_layout", list(k3_tail.ops.columns.WEIGHT_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", SIZES)
@pytest.mark.parametrize("num_tokens", [1, 16, 257])
@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_column_tier_writes_only_its_own_block_everywhere(tp_size, num_tokens, base, dtype, weight_layout):
    config = dataclasses.replace(base, dtype=dtype)
    assert_column_tier_writes_only_its_own_block(config, tp_size, num_tokens, weight_layout)



@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated_output", "sp"])
@pytest.mark.parametrize("codec", ["int8", "int6", "int4"])
@pytest.mark.parametrize("base", SIZES)
@pytest.mark.parametrize("num_tokens", [1, 5, 65])
@pytest.mark.parametrize("tp_size", [2, 8])
@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_every_tier_with_every_codec(tier, weight_layout, tp_size, num_tokens, base, codec, sequence_parallel):
    """Every sum quantised (minimum size 0), within the limit the codec predicts for the inputs."""
    config = dataclasses.replace(base, all_reduce_quantization=codec, quantized_all_reduce_min_bytes=0,
                                 sequence_parallel=sequence_parallel)
    inputs = make_inputs(config, tp_size, num_tokens)
    y = run_tail(config, inputs, tp_size, tier, weight_layout)
    if sequence_parallel:
        y = token_sharded_rows(y, config, num_tokens, tp_size)
    else:
        assert y.shape == (num_tokens, config.hidden_size) and y.dtype == config.dtype
    assert relative_error(y, reference_tail(config, inputs)) <= tolerance(config, inputs)
