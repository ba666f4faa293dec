"""Quantised sums (vLLM ROCm's QuickReduce): the block codecs, the two-shot sum, and when it applies.

Limits come from the codec: one encode-decode moves a value of a block whose largest magnitude is m by
at most ``max_error(m)`` (about one step, m / 2^(b-1)); a two-shot sum rounds each rank's chunk once and
the sum once more, so each value of the sum is within the sum of those bounds of its float64 value.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import k3_tail
from helpers import make_tp_mesh
from k3_tail.ops.codecs import BLOCK, CODECS
from k3_tail.ops.collectives import all_reduce, reduce_scatter
from reference import WRONG_TAILS, block_maxima, make_inputs, reference_tail, relative_error, tolerance

MIB = 2**20
CODEC_NAMES = tuple(CODECS)
# The bounds hold up to float32 arithmetic in the codec and the sum, and bf16's rounding of the result.
ARITHMETIC = 1e-6


@functools.partial(jax.jit, static_argnums=0)
def _encode_decode(codec, blocks):
    encoded = CODECS[codec].encode(blocks)
    return encoded, CODECS[codec].decode(encoded)


def round_trip(codec, blocks):
    """Encode and decode float32 ``blocks`` [n, 32]: (encoded uint8, decoded float64)."""
    encoded, decoded = _encode_decode(codec, jnp.asarray(blocks, jnp.float32))
    return np.asarray(encoded), np.asarray(decoded, np.float64)


def assert_within_codec_bound(codec, blocks, decoded):
    """Every value within ``max_error`` of its block's largest magnitude."""
    blocks = np.asarray(blocks, np.float64)
    bound = np.array([CODECS[codec].max_error(m) for m in np.abs(blocks).max(axis=1)])
    assert np.all(np.abs(decoded - blocks) <= bound[:, None] * (1 + ARITHMETIC))


# --- The codecs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("codec", "block_bytes"), [("int8", 34), ("int6", 26), ("int4", 18)])
def test_a_block_of_32_values_travels_in_b_bits_each_plus_a_two_byte_scale(codec, block_bytes):
    encoded, _ = round_trip(codec, np.ones((3, BLOCK)))
    assert encoded.dtype == np.uint8 and encoded.shape == (3, block_bytes)
    assert CODECS[codec].encoded_bytes(65) == 3 * block_bytes  # the last block padded


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_every_value_is_within_about_one_step_of_its_block_maximum(codec):
    """Blocks of very different magnitudes, from 1e-30 to 1e30: each has its own scale."""
    rng = np.random.default_rng(0)
    blocks = rng.standard_normal((64, BLOCK)) * 10.0 ** rng.integers(-30, 31, size=(64, 1))
    _, decoded = round_trip(codec, blocks)
    assert_within_codec_bound(codec, blocks, decoded)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_every_level_packs_and_unpacks_exactly(codec):
    """Values on the levels of a power-of-two step come back exactly: each of the 2^b levels survives the
    packing of its group of values into bytes, at every position of the block."""
    lowest = CODECS[codec].lowest
    levels = np.arange(lowest, CODECS[codec].highest + 1)
    # Each block: the lowest level (the largest magnitude, which makes the scale exactly -0.25) and the
    # next 31 levels, rolled so that the levels sit at every position across the blocks.
    blocks = np.stack([np.roll(np.concatenate([[lowest], np.resize(np.roll(levels, -start), BLOCK - 1)]), start)
                       for start in range(0, len(levels), 7)])
    values = -0.25 * blocks
    _, decoded = round_trip(codec, values)
    np.testing.assert_array_equal(decoded, values)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_an_all_zero_block_decodes_to_zeros(codec):
    _, decoded = round_trip(codec, np.zeros((2, BLOCK)))
    np.testing.assert_array_equal(decoded, 0.0)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_one_huge_value_among_tiny_ones_keeps_the_huge_one_and_bounds_the_rest(codec):
    block = np.full((1, BLOCK), 1e-3)
    block[0, 7] = 1e4
    _, decoded = round_trip(codec, block)
    assert_within_codec_bound(codec, block, decoded)
    assert abs(decoded[0, 7] - 1e4) <= 1e4 * 2**-8  # the largest value lands on a level: only the scale rounds


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_values_at_both_clamp_edges_stay_within_the_bound(codec):
    """+m lands on the lowest level (the negative scale); -m is clamped to the highest level."""
    block = np.linspace(-1.0, 1.0, BLOCK)[None] * 3.7
    _, decoded = round_trip(codec, block)
    assert_within_codec_bound(codec, block, decoded)
    assert decoded[0, -1] == pytest.approx(3.7, rel=2**-8)
    assert decoded[0, 0] == pytest.approx(-3.7 * CODECS[codec].highest / -CODECS[codec].lowest, rel=2**-8)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_finite_extremes_never_make_a_nan(codec):
    finfo = np.finfo(np.float32)
    blocks = np.array([[finfo.max] * BLOCK, [-finfo.max] + [finfo.tiny] * (BLOCK - 1), [finfo.tiny] * BLOCK])
    _, decoded = round_trip(codec, blocks)
    assert np.all(np.isfinite(decoded))
    assert_within_codec_bound(codec, blocks, decoded)


def blocks_with_non_finite_values(seed=7):
    """64 random blocks, 12 of them holding NaN, +-infinity or only non-finite values, at scattered places."""
    blocks = np.random.default_rng(seed).standard_normal((64, BLOCK)) * np.logspace(-20, 20, 64)[:, None]
    for row, column, value in [(0, 0, np.nan), (1, 31, np.inf), (2, 5, -np.inf), (3, 7, np.nan), (3, 8, np.inf),
                               (40, 16, np.nan), (63, 3, -np.inf)]:
        blocks[row, column] = value
    blocks[4] = np.nan
    blocks[5, ::2] = np.inf
    blocks[6] = 0.0
    blocks[6, 9] = np.nan
    return blocks.astype(np.float32)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_a_non_finite_value_decodes_to_nan_at_its_own_element_only(codec):
    """Whatever XLA's max does with NaN: the non-finite mask of the decoded values is the input's."""
    blocks = blocks_with_non_finite_values()
    _, decoded = round_trip(codec, blocks)
    np.testing.assert_array_equal(np.isnan(decoded), ~np.isfinite(blocks))


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_the_finite_values_beside_a_non_finite_one_keep_the_codec_bound(codec):
    """A marked block codes its finite values with one level fewer, within max_error of its finite maximum."""
    blocks = blocks_with_non_finite_values()
    _, decoded = round_trip(codec, blocks)
    finite = np.isfinite(blocks)
    maxima = np.where(finite, np.abs(blocks.astype(np.float64)), 0).max(axis=1)
    bound = np.array([CODECS[codec].max_error(m) for m in maxima])
    error = np.abs(np.where(finite, decoded - blocks.astype(np.float64), 0))
    assert np.all(error <= bound[:, None] * (1 + ARITHMETIC))


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_only_a_block_with_a_non_finite_value_has_its_scale_sign_bit_clear(codec):
    blocks = blocks_with_non_finite_values()
    encoded, _ = round_trip(codec, blocks)
    sign_bit_clear = (encoded[:, -1] & 0x80) == 0  # the bfloat16 scale's high byte, little-endian
    np.testing.assert_array_equal(sign_bit_clear, ~np.all(np.isfinite(blocks), axis=1))


# --- The two-shot sum ------------------------------------------------------------------------------------------


def quantised_config(codec, dtype=jnp.float32):
    return k3_tail.TailConfig(hidden_size=8, latent_size=8, dtype=dtype, all_reduce_quantization=codec,
                              quantized_all_reduce_min_bytes=0)


def per_rank(function, mesh, partials):
    """``function`` of each rank's [..] partial inside shard_map; the per-rank results stacked [p, ...]."""
    def body(x):
        return function(x[0])[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    return np.asarray(jax.jit(mapped)(jax.device_put(partials, jax.NamedSharding(mesh, P("tp")))), np.float64)


def sum_bound(codec, chunks, requantised):
    """Per value of the p chunks [p, p, n] (sender, owner, values): the bound of a two-shot sum, from block
    maxima of each sender's chunk and of the summed chunk."""
    codec = CODECS[codec]
    per_block = sum(np.array([codec.max_error(m) for m in block_maxima(chunk)]) for chunk in chunks)
    if requantised:
        total = chunks.sum(axis=0)
        # The sum is re-quantised from the decoded one, whose block maximum is within per_block of the exact.
        per_block = per_block + np.array([codec.max_error(m) for m in block_maxima(total) + per_block])
    return np.repeat(per_block, BLOCK)[: chunks.shape[1]]


def assert_all_reduce_within_bound(codec, partials, result, dtype=jnp.float32):
    """Each rank's result [p, ...] within the two-shot bound of the float64 sum of ``partials`` [p, ...] (rank
    k owns the k-th 1/p of the flattened buffer, padded, in blocks of 32), plus the rounding to ``dtype``."""
    tp_size = partials.shape[0]
    exact = partials.astype(np.float64).sum(axis=0)
    chunk = -(-exact.size // tp_size)
    chunks = np.pad(partials.reshape(tp_size, -1).astype(np.float64), [(0, 0), (0, tp_size * chunk - exact.size)])
    bound = np.concatenate([sum_bound(codec, chunks[:, k * chunk:(k + 1) * chunk], True)
                            for k in range(tp_size)])[:exact.size].reshape(exact.shape)
    rounding = float(jnp.finfo(dtype).eps) / 2 * (np.abs(exact) + bound)
    for rank in range(tp_size):
        assert np.all(np.abs(result[rank] - exact) <= bound * (1 + ARITHMETIC) + rounding + ARITHMETIC)


@pytest.mark.parametrize(("codec", "tp_size", "shape"), [
    ("int8", 2, (3, 40)), ("int6", 4, (5, 33)), ("int4", 8, (7, 100)), ("int4", 3, (1, 1)),
])
def test_a_quantised_all_reduce_is_within_the_codec_bound_of_the_exact_sum(codec, tp_size, shape):
    """Sizes that split into neither p chunks nor whole blocks: the flattened buffer is padded for both."""
    rng = np.random.default_rng(1)
    partials = (rng.standard_normal((tp_size, *shape)) * rng.uniform(0.1, 10, (tp_size, *shape))).astype(np.float32)
    config = quantised_config(codec)
    result = per_rank(lambda x: all_reduce(x, axis_name="tp", sums=config.sum_plan(tp_size)),
                      make_tp_mesh(tp_size), partials)
    assert_all_reduce_within_bound(codec, partials, result)


def test_every_rank_decodes_the_same_quantised_sum():
    rng = np.random.default_rng(2)
    partials = rng.standard_normal((8, 4, 96)).astype(np.float32)
    result = per_rank(lambda x: all_reduce(x, axis_name="tp", sums=quantised_config("int4").sum_plan(8)),
                      make_tp_mesh(8), partials)
    assert np.all(result == result[0])


@pytest.mark.parametrize(("codec", "scatter_dimension"), [("int8", 0), ("int4", 1)])
def test_a_quantised_reduce_scatter_rounds_once_and_keeps_the_own_block(codec, scatter_dimension):
    """The scatter half alone: rank k gets block k along the dimension, rounded once per sender."""
    tp_size, shape = 4, (8, 12)
    rng = np.random.default_rng(3)
    partials = rng.standard_normal((tp_size, *shape)).astype(np.float32)
    result = per_rank(lambda x: reduce_scatter(x, axis_name="tp", sums=quantised_config(codec).sum_plan(tp_size),
                                               scatter_dimension=scatter_dimension),
                      make_tp_mesh(tp_size), partials)
    exact = np.split(partials.astype(np.float64).sum(axis=0), tp_size, axis=scatter_dimension)
    for rank in range(tp_size):
        senders = np.stack([np.split(partial, tp_size, axis=scatter_dimension)[rank].reshape(-1)
                            for partial in partials.astype(np.float64)])
        bound = sum_bound(codec, senders, False).reshape(exact[rank].shape)
        assert np.all(np.abs(result[rank] - exact[rank]) <= bound * (1 + ARITHMETIC) + ARITHMETIC)


def test_a_sum_that_overflows_float32_saturates_instead_of_making_a_nan():
    """Finite bf16 inputs whose sum is beyond float32's range: no NaN (bf16 rounds it to +-inf, as a plain sum does)."""
    big = float(jnp.finfo(jnp.bfloat16).max)
    partials = np.full((4, 2, 32), big, np.float32)
    partials[:, 1] = -big
    result = per_rank(lambda x: all_reduce(x.astype(jnp.bfloat16), axis_name="tp",
                                           sums=quantised_config("int4", jnp.bfloat16).sum_plan(4)),
                      make_tp_mesh(4), partials)
    assert not np.any(np.isnan(result))


# --- When a sum is quantised -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "tp_size", "expected"), [
    ({"all_reduce_quantization": "int4"}, 8, 2 * MIB),  # vLLM's fp16 TP8 row, which bf16 follows by default
    ({"all_reduce_quantization": "int8"}, 4, 16 * MIB),
    ({"all_reduce_quantization": "int8", "quantized_all_reduce_fp16_sizes_for_bf16": False}, 8, 2048 * MIB),
    ({"all_reduce_quantization": "int6", "dtype": jnp.float16}, 2, 2 * MIB),
    ({"all_reduce_quantization": "int4"}, 3, 1 * MIB),  # no TP3 row: TP2's
    ({"all_reduce_quantization": "int4"}, 16, 2 * MIB),  # beyond QuickReduce's 8 ranks: TP8's
    ({"all_reduce_quantization": "int4", "quantized_all_reduce_min_bytes": 0}, 8, 0),
    ({"all_reduce_quantization": "int4"}, 1, None),  # one rank: nothing travels
    ({"all_reduce_quantization": "int4", "dtype": jnp.float32}, 8, None),  # vLLM has no float32 table
    ({"all_reduce_quantization": "int4", "dtype": jnp.float32, "quantized_all_reduce_min_bytes": 5}, 8, 5),
    ({}, 8, None),
], ids=["int4-tp8", "int8-tp4", "int8-bf16-table", "fp16-tp2", "tp3", "tp16", "explicit-0", "p1", "f32",
        "f32-explicit", "off"])
def test_the_smallest_quantised_buffer_follows_vllms_table(overrides, tp_size, expected):
    assert k3_tail.TailConfig.kimi_k3(**overrides).quantization_min_bytes(tp_size) == expected


def test_a_buffer_is_quantised_inside_the_size_window_only():
    config = k3_tail.TailConfig.kimi_k3(all_reduce_quantization="int4", quantized_all_reduce_max_bytes=4 * MIB)
    assert [config.sum_plan(8).codec_for(nbytes) for nbytes in (2 * MIB - 1, 2 * MIB, 4 * MIB, 4 * MIB + 1)] == [
        None, CODECS["int4"], CODECS["int4"], None]
    assert dataclasses.replace(config, quantized_all_reduce_min_bytes=0).sum_plan(8).codec_for(0) is None  # empty


def test_the_selection_reason_says_which_sums_are_quantised():
    config = k3_tail.TailConfig.kimi_k3(all_reduce_quantization="int4")
    prefill, decode = (k3_tail.select_tier(config, tokens, 8).reason for tokens in (2048, 16))
    assert "int4-quantised" in prefill and "quantised here: all-reduce of 14.7 MB, all-reduce of 29.4 MB" in prefill
    assert "quantised here: none" in decode


def test_no_policy_quantises_by_itself():
    assert k3_tail.TailConfig.kimi_k3().all_reduce_quantization is None
    assert "quantis" not in k3_tail.select_tier(k3_tail.TailConfig.kimi_k3(), 2048, 8).reason


# --- The tail with quantised sums ------------------------------------------------------------------------------


# Under the norm the scale cancels: "unscaled" is no wrong tail there (tests/test_tiers.py).
@pytest.mark.parametrize("wrong", [name for name in WRONG_TAILS if name != "unscaled"])
def test_the_int4_tolerance_still_detects_a_wrong_tail(wrong):
    """The allowance for int4's rounding is far below what dropping a term costs."""
    config = k3_tail.TailConfig(hidden_size=96, latent_size=64, all_reduce_quantization="int4",
                                quantized_all_reduce_min_bytes=0)
    inputs = make_inputs(config, 8, 16)
    expected = reference_tail(config, inputs)
    assert relative_error(reference_tail(*WRONG_TAILS[wrong](config, inputs)), expected) > 2 * tolerance(config, inputs)


def test_a_tail_without_the_codec_builds_the_program_of_before():
    """all_reduce_quantization=None (and a codec whose window holds no buffer) trace exactly what was traced before."""
    mesh = make_tp_mesh(8)

    def lowered(config):
        arguments = k3_tail.xla.compilation.tail_arguments(config, mesh, 16)
        return jax.jit(lambda *a: k3_tail.tail_forward(*a, config=config, mesh=mesh, tier="overlap")).lower(
            *arguments).as_text()

    assert lowered(k3_tail.TailConfig.kimi_k3(all_reduce_quantization="int4")) == lowered(k3_tail.TailConfig.kimi_k3())


def test_reduce_shared_quantises_the_shared_sum():
    config = dataclasses.replace(quantised_config("int8", jnp.bfloat16), hidden_size=64, shared_output_is_reduced=True)
    rng = np.random.default_rng(4)
    partials = rng.standard_normal((4, 3, 64)).astype(np.float32)
    result = per_rank(lambda x: k3_tail.reduce_shared(x.astype(jnp.bfloat16), config=config, axis_name="tp"),
                      make_tp_mesh(4), partials)
    assert np.any(result[0] != partials.astype(np.float64).sum(axis=0))
    assert_all_reduce_within_bound("int8", partials, result, jnp.bfloat16)


def test_a_measured_table_refuses_other_quantised_sums():
    """A table measured with bf16 sums does not choose for int4 sums (nor for another minimum), and a table
    written before quantised sums existed reads as measured with bf16 sums."""
    config = k3_tail.TailConfig(hidden_size=96, latent_size=64)
    table = k3_tail.SelectionTable(device_kind="cpu", tp_size=8, weight_layout="column", hidden_size=96,
                                   latent_size=64, dtype="bfloat16",
                                   ranges=(k3_tail.selection.table.TokenRange(1, None, k3_tail.Tier.OVERLAP),))
    table.check_matches(config, 8)
    with pytest.raises(ValueError, match=r"^selection_table: measured with all_reduce_quantization=None"):
        table.check_matches(dataclasses.replace(config, all_reduce_quantization="int4"), 8)
    quantised = dataclasses.replace(table, all_reduce_quantization="int4")
    with pytest.raises(ValueError, match=r"^selection_table: measured with quantized_all_reduce_min_bytes=None"):
        quantised.check_matches(dataclasses.replace(config, all_reduce_quantization="int4",
                                                    quantized_all_reduce_min_bytes=0), 8)
    assert k3_tail.SelectionTable.from_dict(quantised.to_dict()) == quantised
    older = {key: value for key, value in table.to_dict().items() if "quantiz" not in key}
    assert k3_tail.SelectionTable.from_dict(older) == table
