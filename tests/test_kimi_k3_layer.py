"""The Kimi-K3 latent MoE layer of k3_tail/models/kimi_k3/layer.py: the tail inside the layer it ends.

The whole layer (router, routed down projection, routed experts with their intermediate width split
over the ranks, column/row-parallel shared experts, then ``k3_tail.latent_moe_tail`` per rank) is
checked against the float64 numpy reference of k3_tail/models/kimi_k3/reference.py at tiny widths:
H 64, L 32, routed-expert width 16, shared width 24, 8 experts, top 2.

The parity cases are a covering design (tests/covering.py) over the tail tier (each one forced, and
"selected") x p in {1, 2, 8} x T in {1, 16, 300} x the up projection's layout x dtype x replicated or
sequence-parallel output x the shared reduction issued early (``k3_tail.reduce_shared`` before the routed
experts, the default) or inside the tail: every pair of values of two factors but the tier's with p and T
(tests/test_tiers.py's design pairs those), each tier at some p > 1; ``pytest -m slow`` runs their full
product. T = 1 takes the
routed experts' gather method (T*k <= E), T = 16 and 300 the capacity method (each method alone, and
the choice between them: tests/test_kimi_k3_routed_experts.py); 300 is above the overlap tier's threshold.

Tolerance, relative Frobenius error ||y - ref|| / ||ref||: bf16 <= 1e-2 (measured up to 6.3e-3 over
the full product: z, the SiTU outputs, both partials, the tail's collectives and y are each rounded
to bf16), float32 <= 1e-5 (measured up to 3.4e-7).

Structure: at T = 1 every product of the lowered layer multiplies at least two rows
(k3_tail/models/kimi_k3/gemm.py), so XLA's GPU pipeline does not strength-reduce one into a multiply that copies
its kernel in float32 (what it cost on ROCm: tests/test_kimi_k3_routed_experts.py's decode temp memory).
"""

import dataclasses
import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import covering
import k3_tail
from helpers import FAST_COMPILE_OPTIONS, make_tp_mesh, token_sharded_rows
from k3_tail.models.kimi_k3 import (
    LayerConfig,
    abstract_parameters,
    cost as layer_cost,
    layer as layer_module,
    partition_specs,
    random_checkpoint,
)
from k3_tail.models.kimi_k3.gemm import matmul
from k3_tail.models.kimi_k3.packed_parameters import held_partition_specs
from k3_tail.models.kimi_k3.per_rank import route
from k3_tail.models.kimi_k3.reference import choice_margin, reference_layer, reference_partials
from k3_tail.models.kimi_k3.routed_experts import ROUTED_EXPERTS, routed_expert_method
from k3_tail.selection import cost_model
from reference import TOLERANCE, relative_error, tolerance

HIDDEN, LATENT, EXPERT_WIDTH, SHARED_WIDTH, EXPERTS, TOP_K = 64, 32, 16, 24, 8, 2
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
LAYER_FACTORS = {
    "tier": covering.TIERS,
    "tp_size": (1, 2, 8),
    "num_tokens": (1, 16, 300),
    "weight_layout": covering.WEIGHT_LAYOUTS,
    "dtype": tuple(DTYPES),
    "sequence_parallel": (False, True),
    # The shared reduction issued before the routed experts (the default) or inside the tail.
    "early_shared_reduction": (True, False),
}
# float32 rounding moves a score by about 1e-7: a margin far above that picks the same experts in
# float32 and float64.
MIN_CHOICE_MARGIN = 1e-5
STATIC_ARGUMENTS = ("config", "mesh", "axis_name", "weight_layout", "tier")
# Compiled fast (helpers.FAST_COMPILE_OPTIONS): the same programs, in a quarter of the compile time.
layer_forward = jax.jit(layer_module.layer_forward, static_argnames=STATIC_ARGUMENTS,
                        compiler_options=FAST_COMPILE_OPTIONS)
layer_partials = jax.jit(layer_module.layer_partials, static_argnames=STATIC_ARGUMENTS[:-1],
                         compiler_options=FAST_COMPILE_OPTIONS)


@dataclasses.dataclass(frozen=True)
class LayerCase:
    tier: str
    tp_size: int
    num_tokens: int
    weight_layout: str
    dtype: str
    sequence_parallel: bool
    early_shared_reduction: bool

    @property
    def id(self) -> str:
        output = "sp" if self.sequence_parallel else "nosp"
        shared = "early" if self.early_shared_reduction else "intail"
        return f"{self.tier}-p{self.tp_size}-T{self.num_tokens}-{self.weight_layout}-{self.dtype}-{output}-{shared}"


def layer_cases(design):
    return [pytest.param(case, id=case.id) for case in (LayerCase(**values) for values in design)]


# Every pair of values of two factors but the tier's with p and T (tests/test_tiers.py's design pairs those); each
# tier at p = 8 (seeds), and one case returning token-sharded rows (p divides T), a three-way interaction pairs
# alone would not force.
TOKEN_SHARDED_SEED = {"tp_size": 8, "num_tokens": 16, "sequence_parallel": True}
TIER_SEEDS = tuple({"tier": tier, "tp_size": 8} for tier in covering.TIERS)
EXEMPT = (("tier", "tp_size"), ("tier", "num_tokens"))
LAYER_DESIGN = covering.pairwise_cases(LAYER_FACTORS, constraint=covering.tail_constraint,
                                       seeds=[TOKEN_SHARDED_SEED, *TIER_SEEDS], exempt=EXEMPT)
PAIRWISE_CASES = layer_cases(LAYER_DESIGN)
PRODUCT = (dict(zip(LAYER_FACTORS, values, strict=True)) for values in itertools.product(*LAYER_FACTORS.values()))
FULL_PRODUCT = layer_cases(case for case in PRODUCT if covering.tail_constraint(case))


def layer_config(dtype, early_shared_reduction=True, **tail_changes):
    tail = k3_tail.TailConfig(hidden_size=HIDDEN, latent_size=LATENT, dtype=DTYPES[dtype], **tail_changes)
    return LayerConfig(tail, num_experts=EXPERTS, top_k=TOP_K, expert_intermediate_size=EXPERT_WIDTH,
                       shared_intermediate_size=SHARED_WIDTH,
                       early_shared_reduction=early_shared_reduction)


@functools.cache
def checkpoint(dtype):
    return random_checkpoint(layer_config(dtype), seed=0)


@functools.cache
def hidden_states(num_tokens, dtype):
    rng = np.random.default_rng(num_tokens)
    return np.asarray(jnp.asarray(rng.standard_normal((num_tokens, HIDDEN)), DTYPES[dtype]))


@functools.cache
def layer_on(tp_size, dtype, weight_layout="replicated", sequence_parallel=False, early_shared_reduction=True):
    config = layer_config(dtype, early_shared_reduction, sequence_parallel=sequence_parallel)
    return layer_module.KimiK3MoELayer(config, make_tp_mesh(tp_size), checkpoint(dtype), weight_layout=weight_layout)


def run_layer(layer, x, tier=None):
    """``layer(x, tier=tier)``: the same call of layer_forward on the layer's parameters, compiled fast."""
    return layer_forward(layer.parameter_values(), jnp.asarray(x), config=layer.config, mesh=layer.mesh,
                         weight_layout=layer.weight_layout, tier=tier)


def expected(config, x):
    return reference_layer(checkpoint(config.dtype.name), x, top_k=TOP_K, rms_norm_eps=config.tail.rms_norm_eps,
                           routed_scaling_factor=config.tail.routed_scaling_factor)


def assert_matches_reference(case):
    """y of the case's layer matches the reference; it is replicated, or with sequence-parallel output each
    rank holds its T'/p rows of y padded to T' = padded_token_count(T, p), the padding zero."""
    layer = layer_on(case.tp_size, case.dtype, case.weight_layout, case.sequence_parallel, case.early_shared_reduction)
    x = hidden_states(case.num_tokens, case.dtype)
    y = run_layer(layer, x, tier=None if case.tier == "selected" else case.tier)
    if case.sequence_parallel:
        y = token_sharded_rows(y, layer.config.tail, case.num_tokens, case.tp_size)
    else:
        assert y.shape == (case.num_tokens, HIDDEN) and y.dtype == DTYPES[case.dtype]
        assert y.sharding.is_fully_replicated
    assert relative_error(y, expected(layer.config, x)) <= TOLERANCE[np.dtype(DTYPES[case.dtype])]


@pytest.mark.parametrize("case", PAIRWISE_CASES)
def test_layer_matches_the_float64_reference(case):
    assert_matches_reference(case)


def test_the_design_covers_its_pairs_and_runs_every_tier_on_several_ranks():
    """The pairs the design above promises, each tier at some p > 1, and the token-sharded case."""
    assert covering.uncovered_pairs(LAYER_FACTORS, LAYER_DESIGN, constraint=covering.tail_constraint,
                                    exempt=EXEMPT) == []
    assert {case["tier"] for case in LAYER_DESIGN if case["tp_size"] > 1} == set(covering.TIERS)
    assert any(TOKEN_SHARDED_SEED.items() <= case.items() for case in LAYER_DESIGN)


@pytest.mark.parametrize(
    ("up_proj_dtype", "fp8_activations", "weight_layout", "tp_size", "num_tokens"),
    [("float8_e4m3fn", False, "column", 8, 16), ("float8_e4m3fnuz", True, "replicated", 2, 300)],
    ids=["e4m3fn-column-p8-T16", "e4m3fnuz-fp8act-replicated-p2-T300"],
)
def test_layer_with_an_fp8_up_projection_matches_the_reference(up_proj_dtype, fp8_activations, weight_layout,
                                                               tp_size, num_tokens):
    """The checkpoint's kernel quantised at load (FP8 values, per-column scales sharded with the columns):
    the layer matches the reference built from the same values and scales."""
    config = layer_config("bfloat16", up_proj_dtype=up_proj_dtype, fp8_activations=fp8_activations)
    weights = random_checkpoint(config, seed=0)
    layer = layer_module.KimiK3MoELayer(config, make_tp_mesh(tp_size), weights, weight_layout=weight_layout)
    assert layer.parameter_values()["up_proj_kernel"].dtype == jnp.dtype(up_proj_dtype)
    x = hidden_states(num_tokens, "bfloat16")
    y = run_layer(layer, x)
    reference = reference_layer(weights, x, top_k=TOP_K, rms_norm_eps=config.tail.rms_norm_eps,
                                routed_scaling_factor=config.tail.routed_scaling_factor)
    assert relative_error(y, reference) <= tolerance(config.tail)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_routing_weights_are_renormalised_only_above_top_1(top_k):
    """At top_k = 1 the weight is the chosen expert's sigmoid score (below 1), as in Kimi-K3's reference;
    above, the chosen scores divided by their sum."""
    weights, x = checkpoint("float32"), hidden_states(16, "float32")
    chosen, combine = route(jnp.asarray(x), weights["router_kernel"], weights["router_bias"], top_k=top_k)
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ weights["router_kernel"])))
    picked = np.take_along_axis(scores, np.asarray(chosen), axis=1)
    expected = picked / picked.sum(axis=1, keepdims=True) if top_k > 1 else picked
    np.testing.assert_allclose(np.asarray(combine), expected, rtol=1e-5)
    assert top_k > 1 or np.all(np.asarray(combine) < 1)


def test_the_routed_latent_of_a_layer_routing_to_one_expert_matches_the_reference():
    """Compared before the tail: the norm divides a row's scale out, so y barely shows a weight of 1 in place
    of the score."""
    config = dataclasses.replace(layer_config("float32"), top_k=1)
    x = hidden_states(16, "float32")
    assert choice_margin(checkpoint("float32"), x, top_k=1) > MIN_CHOICE_MARGIN
    layer = layer_module.KimiK3MoELayer(config, make_tp_mesh(2), checkpoint("float32"))
    routed, _ = layer_partials(layer.parameter_values(), jnp.asarray(x), config=config, mesh=layer.mesh)
    expected, _ = reference_partials(checkpoint("float32"), x, top_k=1)
    assert relative_error(np.asarray(routed, np.float64).sum(axis=0), expected) <= 1e-5


def test_a_forced_routed_expert_method_runs_at_any_t_and_matches_the_reference():
    """LayerConfig(routed_experts=...) makes every call take that method: ragged_dot, which selection never picks,
    at T = 16, where it would pick capacity (the covering design runs the selected methods)."""
    method = "ragged_dot"
    config = dataclasses.replace(layer_config("bfloat16"), routed_experts=method)
    assert routed_expert_method(config, 16).method == method
    layer = layer_module.KimiK3MoELayer(config, make_tp_mesh(2), checkpoint("bfloat16"))
    x = hidden_states(16, "bfloat16")
    assert relative_error(run_layer(layer, x), expected(config, x)) <= TOLERANCE[np.dtype(jnp.bfloat16)]


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL_PRODUCT)
def test_layer_matches_the_float64_reference_full_product(case):
    assert_matches_reference(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", LAYER_FACTORS["num_tokens"])
def test_no_test_input_is_near_a_routing_tie(num_tokens, dtype):
    """Otherwise float32 rounding could choose other experts than the float64 reference does."""
    assert choice_margin(checkpoint(dtype), hidden_states(num_tokens, dtype), top_k=TOP_K) > MIN_CHOICE_MARGIN


@pytest.mark.parametrize("weight_layout", covering.WEIGHT_LAYOUTS)
def test_each_rank_holds_its_block_of_every_expert_and_of_the_shared_experts(weight_layout):
    layer = layer_on(8, "bfloat16", weight_layout)
    up_block = (LATENT, HIDDEN // 8) if weight_layout == "column" else (LATENT, HIDDEN)
    shard_shapes = {
        # Router [H, E], down projection [H, L] and the rank's shared gate and up blocks [H, F/p], packed.
        "input_kernel": (HIDDEN, EXPERTS + LATENT + 2 * SHARED_WIDTH // 8), "router_bias": (EXPERTS,),
        "expert_gate": (EXPERTS, LATENT, EXPERT_WIDTH // 8), "expert_up": (EXPERTS, LATENT, EXPERT_WIDTH // 8),
        "expert_down": (EXPERTS, EXPERT_WIDTH // 8, LATENT),
        "shared_down": (SHARED_WIDTH // 8, HIDDEN), "norm_scale": (LATENT,), "up_proj_kernel": up_block, "rank": (1,),
    }
    values = layer.parameter_values()
    assert {name: {shard.data.shape for shard in values[name].addressable_shards} for name in values} == {
        name: {shape} for name, shape in shard_shapes.items()}
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer, nnx.Param)))
    held = held_partition_specs(layer.config, 8, weight_layout=weight_layout)
    assert specs == {name: spec for name, spec in held.items() if name != "rank"}


def test_the_checkpoint_values_are_the_checkpoint_the_layer_was_built_from():
    layer = layer_on(8, "bfloat16")
    values = layer.checkpoint_values()
    assert set(values) == set(checkpoint("bfloat16"))
    for name, value in values.items():
        np.testing.assert_array_equal(np.asarray(value), checkpoint("bfloat16")[name], err_msg=name)


def test_each_rank_is_given_its_index():
    layer = layer_on(8, "bfloat16")
    rank = layer.parameter_values()["rank"]
    assert [int(shard.data[0]) for shard in rank.addressable_shards] == [
        list(layer.mesh.devices.flat).index(shard.device) for shard in rank.addressable_shards]


def test_the_ranks_partials_sum_to_the_routed_latent_and_the_shared_output():
    layer = layer_on(8, "float32")
    x = hidden_states(16, "float32")
    routed, shared = layer_partials(layer.parameter_values(), jnp.asarray(x), config=layer.config, mesh=layer.mesh)
    assert routed.shape == (8, 16, LATENT) and shared.shape == (8, 16, HIDDEN)
    expected_routed, expected_shared = reference_partials(checkpoint("float32"), x, top_k=TOP_K)
    assert relative_error(np.asarray(routed, np.float64).sum(axis=0), expected_routed) <= 1e-5
    assert relative_error(np.asarray(shared, np.float64).sum(axis=0), expected_shared) <= 1e-5


@pytest.fixture(scope="module")
def decode_loop():
    """A decode loop under jax.jit, T = 5, 6, 7, 8, 9, 12 tokens per step, each step's hidden states padded
    to its power-of-two bucket; returns (the layer, the token counts each trace saw, {T: (x, y's T rows)})."""
    layer = layer_on(8, "bfloat16")
    traces = []

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE_OPTIONS)
    def step(parameters, x):
        traces.append(x.shape[0])  # runs only when jit traces
        return layer_module.layer_forward(parameters, x, config=layer.config, mesh=layer.mesh)

    outputs = {}
    for num_tokens in (5, 6, 7, 8, 9, 12):
        x = hidden_states(num_tokens, "bfloat16")
        y = step(layer.parameter_values(), jnp.asarray(layer_module.pad_to_bucket(x)))
        outputs[num_tokens] = x, np.asarray(y)[:num_tokens]
    return layer, traces, outputs


def test_a_bucketed_decode_loop_traces_once_per_bucket(decode_loop):
    _, traces, _ = decode_loop
    assert traces == [8, 16]


def test_bucket_padding_leaves_the_real_rows_unchanged(decode_loop):
    layer, _, outputs = decode_loop
    for num_tokens, (x, y) in outputs.items():
        assert y.shape == (num_tokens, HIDDEN)
        assert relative_error(y, expected(layer.config, x)) <= TOLERANCE[np.dtype(jnp.bfloat16)]


def test_the_layer_lowers_from_abstract_parameters():
    """What a deviceless GPU compile needs: no values, only shapes and shardings."""
    config = layer_config("bfloat16")
    mesh = make_tp_mesh(2)
    x = jax.ShapeDtypeStruct((3, HIDDEN), config.dtype, sharding=NamedSharding(mesh, P()))
    lowered = layer_module.layer_forward.lower(abstract_parameters(config, mesh), x, config=config,
                                               mesh=mesh, tier="overlap")
    assert lowered.out_info.shape == (3, HIDDEN)


# A StableHLO dot_general: its batch and contracting dimensions per side and its operand types.
DOT_GENERAL = re.compile(r"stablehlo\.dot_general .*?(?:batching_dims = \[([\d, ]*)\] x \[([\d, ]*)\], )?"
                         r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\].*?: \(tensor<([^>]*)>, tensor<([^>]*)>\)")


def dot_sides(text):
    """Per dot_general of a lowered program: the (lhs, rhs) sizes of the dimensions that are neither batch nor
    contracting (its free dimensions: rows of one side, columns of the other)."""
    def free(shape, batch, contracting):
        dims = [int(size) for size in shape.split("x")[:-1]]
        taken = {int(i) for i in f"{batch},{contracting}".split(",") if i.strip()}
        return tuple(size for i, size in enumerate(dims) if i not in taken)

    return [(free(lhs, lb or "", lc), free(rhs, rb or "", rc))
            for lb, rb, lc, rc, lhs, rhs in DOT_GENERAL.findall(text)]


@pytest.mark.parametrize("early_shared_reduction", [True, False], ids=["early", "intail"])
@pytest.mark.parametrize("method", ROUTED_EXPERTS)
def test_no_product_of_the_layer_has_a_single_row_at_one_token(method, early_shared_reduction):
    """XLA's GPU pipeline rewrites a dot with a vector side (one row: [1, K] x [K, N]) into a multiply that writes
    a float32 copy of the kernel and a reduce; every product of the layer (router, down projection, shared experts,
    each method's expert products, the tail's up projection) multiplies at least two rows (models/kimi_k3/gemm.py).
    Checked in the lowered program at T = 1, as the GPU compiler receives it."""
    config = dataclasses.replace(layer_config("bfloat16", early_shared_reduction), routed_experts=method)
    mesh = make_tp_mesh(2)
    x = jax.ShapeDtypeStruct((1, HIDDEN), config.dtype, sharding=NamedSharding(mesh, P()))
    text = layer_module.layer_forward.lower(abstract_parameters(config, mesh), x, config=config,
                                            mesh=mesh).as_text()
    sides = dot_sides(text)
    # The packed input kernel (router, down projection, shared gate and up), the shared down and up projections.
    assert len(sides) == text.count("stablehlo.dot_general") >= 3
    vector_sides = [dot for dot in sides if any(math.prod(side) <= 1 for side in dot)]
    assert not vector_sides


@pytest.mark.parametrize(("a_shape", "b_shape"),
                         [((1, 6), (6, 5)), ((3, 6), (6, 5)), ((4, 1, 6), (4, 6, 5)), ((0, 6), (6, 5))],
                         ids=["one-row", "rows", "batched-one-row", "empty"])
def test_the_layer_product_is_the_float32_matrix_product(a_shape, b_shape):
    """gemm.matmul: a @ b in float32, its shape, also for one row (padded to two, then sliced)."""
    rng = np.random.default_rng(3)
    a, b = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in (a_shape, b_shape))
    product = matmul(a, b)
    assert product.dtype == jnp.float32 and product.shape == (*a_shape[:-1], b_shape[-1])
    expected = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    np.testing.assert_allclose(np.asarray(product), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("num_tokens", "expected_experts"), [(1, 16), (1 << 20, 896)])
def test_the_cost_model_reads_each_chosen_expert_once(num_tokens, expected_experts):
    kimi = LayerConfig.kimi_k3(num_experts=896, top_k=16)
    assert layer_cost.experts_read(kimi.sizes, num_tokens) == pytest.approx(expected_experts)


def test_a_tiers_predicted_layer_gain_is_the_tail_time_it_saves_over_the_native_layer():
    kimi = LayerConfig.kimi_k3(num_experts=896, top_k=16)
    tails = {tier: cost_model.predict_time(cost_model.tier_cost(kimi.tail, 64, 8, tier=tier),
                                                   "mi355x").total_s for tier in ("native", "overlap")}
    native = layer_cost.predict_layer(kimi.sizes, 64, 8, tier="native", hardware="mi355x")
    assert native.tail_s == tails["native"]
    gain = layer_cost.layer_gain(kimi.sizes, 64, 8, tier="overlap", hardware="mi355x")
    assert gain == pytest.approx((tails["native"] - tails["overlap"]) / native.total_s)


SLOW_LINK_H200 = dataclasses.replace(cost_model.HARDWARE["h200"], name="h200, 1 GB/s links",
                                     link_bytes_per_s=1e9)


@pytest.mark.parametrize(("hardware", "exposed"), [(cost_model.HARDWARE["h200"], False),
                                                   (SLOW_LINK_H200, True)], ids=["h200", "slow-links"])
def test_the_early_shared_reduction_is_predicted_to_expose_only_what_the_routed_work_does_not_hide(hardware, exposed):
    """Native's tail without its shared all-reduce, plus what of that all-reduce outlasts the router, the down
    projection and the routed experts (at T = 8192 on an H200 nothing: the routed work is longer)."""
    early, late = (LayerConfig.kimi_k3(num_experts=896, top_k=16, early_shared_reduction=flag)
                   for flag in (True, False))
    predictions = [layer_cost.predict_layer(config.sizes, 8192, 8, tier="native", hardware=hardware)
                   for config in (early, late)]
    reduction_s = layer_cost.shared_reduction(early.sizes, 8192, 8).seconds(hardware)
    routed_s = sum(kernel.seconds(hardware) for kernel in layer_cost.layer_kernels(early.sizes, 8192, 8)
                   if kernel.name != "shared experts")
    assert predictions[0].shared_exposed_s == max(0.0, reduction_s - routed_s)
    assert (predictions[0].shared_exposed_s > 0) is exposed
    saved = predictions[1].total_s - predictions[0].total_s
    assert saved == pytest.approx(reduction_s - predictions[0].shared_exposed_s)


def test_a_quantised_early_shared_reduction_is_priced_quantised():
    """With int4 sums the early reduction of T = 8192 (112 MiB) travels quantised; at T = 16 (0.2 MiB, below
    vLLM's 2 MiB minimum) it stays bf16."""
    config = LayerConfig.kimi_k3(num_experts=896, top_k=16, all_reduce_quantization="int4")
    assert [layer_cost.shared_reduction(config.sizes, tokens, 8).codec for tokens in (16, 8192)] == [None, "int4"]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: layer_module.KimiK3MoELayer(layer_config("float32"), make_tp_mesh(2),
                                             {**checkpoint("float32"), "down_proj": np.zeros((HIDDEN, 3))}),
         r"^checkpoint: expected down_proj of shape \(64, 32\)"),
        (lambda: layer_module.KimiK3MoELayer(layer_config("float32"), make_tp_mesh(2),
                                             {k: v for k, v in checkpoint("float32").items() if k != "router_bias"}),
         r"^checkpoint: expected the names"),
        (lambda: partition_specs(layer_config("float32"), 3), r"^expert_intermediate_size: expected a "
                                                                           r"multiple of the TP size 3"),
        (lambda: layer_on(2, "float32")(jnp.zeros((3, HIDDEN), jnp.bfloat16)),
         r"^hidden_states: expected a \[T, 64\] array of float32"),
        (lambda: layer_config("float32", has_shared_experts=False), r"^tail: the layer has shared experts"),
        (lambda: layer_config("float32", early_shared_reduction=1), r"^early_shared_reduction: expected a bool"),
        (lambda: dataclasses.replace(layer_config("float32"), routed_experts="sort"),
         r"^routed_experts: expected None or one of \('gather', 'capacity', 'ragged_dot'\)"),
        (lambda: LayerConfig.kimi_k3(width_divisor=3), r"^width_divisor: expected a positive divisor"),
    ],
    ids=["checkpoint-shape", "checkpoint-names", "tp-size", "hidden-states-dtype", "tail-config", "early-not-bool",
         "routed-experts-name", "width-divisor"],
)
def test_bad_input_is_a_value_error_naming_it(build, message):
    with pytest.raises(ValueError, match=message):
        build()
