"""latent_moe_tail: the per-rank entry point, called inside a model's own shard_map.

The model here is what tpu-inference and maxtext write: one ``jax.shard_map`` over a 2-d mesh whose
TP group spans both axes (``axis_name=("x", "y")``, p = 8), in which each rank finishes its routed
experts with a row-parallel down projection (its [T, L] latent partial) and its shared experts with
a row-parallel output projection (its [T, H] partial), then runs the tail.
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
import k3_tail.selection.cost_model
from helpers import make_tp_mesh, preferred_tier_layouts, token_sharded_rows
from reference import TOLERANCE, make_inputs, reference_tail, relative_error

TP = ("x", "y")
P_SIZE = 8
EXPERT_WIDTH, SHARED_WIDTH = 32, 48  # intermediate widths, split over the 8 ranks
CONFIG = k3_tail.TailConfig(hidden_size=97, latent_size=64, dtype=jnp.float32)  # 97: padded column blocks


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < P_SIZE:
        pytest.skip(f"needs {P_SIZE} devices")
    return jax.make_mesh((2, 4), TP, devices=jax.devices()[:P_SIZE])


@dataclasses.dataclass(frozen=True)
class Layer:
    """A layer's activations and weights as global arrays (float64 on the host)."""

    expert_act: np.ndarray  # [T, E]: routed experts' activations, column-parallel
    down: np.ndarray  # [E, L]: their down projection, row-parallel
    shared_act: np.ndarray  # [T, F]
    shared_out: np.ndarray  # [F, H]
    norm_weight: np.ndarray  # [L]
    kernel: np.ndarray  # [L, H]

    @classmethod
    def random(cls, config, num_tokens, seed=0):
        rng = np.random.default_rng(seed)
        latent, hidden = config.latent_size, config.hidden_size

        def draw(*shape, scale=1.0):
            return np.asarray(jnp.asarray(scale * rng.standard_normal(shape), config.dtype), np.float64)

        return cls(
            draw(num_tokens, EXPERT_WIDTH), draw(EXPERT_WIDTH, latent, scale=EXPERT_WIDTH ** -0.5),
            draw(num_tokens, SHARED_WIDTH), draw(SHARED_WIDTH, hidden, scale=SHARED_WIDTH ** -0.5),
            1 + draw(latent, scale=0.1), draw(latent, hidden, scale=latent ** -0.5),
        )

    def reference(self, config):
        """y in float64, from the summed partials (the per-rank partials add up to these products)."""
        routed = (self.expert_act @ self.down)[None]
        shared = (self.shared_act @ self.shared_out)[None]
        inputs = dataclasses.replace(make_inputs(config, 1, 0), routed=routed, shared=shared,
                                     norm_weight=self.norm_weight, kernel=self.kernel)
        return reference_tail(config, inputs)


def run_layer(mesh, config, layer, *, tier=None, weight_layout="replicated", lower_only=False):
    """The model: one shard_map over ``mesh``; each rank computes its partials (reducing the shared one
    itself with ``config.shared_output_is_reduced``), then the tail."""
    num_tokens = layer.expert_act.shape[0]
    kernel = layer.kernel
    kernel_spec = P()
    if weight_layout == "column":
        width = k3_tail.padded_hidden_size(config.hidden_size, P_SIZE)
        kernel = np.pad(kernel, [(0, 0), (0, width - config.hidden_size)])
        kernel_spec = P(None, TP)
    token_sharded = k3_tail.is_token_sharded_output(config, num_tokens, P_SIZE)

    def per_rank(expert_act, down, shared_act, shared_out, norm_weight, up_proj_kernel):
        shared = jnp.dot(shared_act, shared_out, preferred_element_type=jnp.float32).astype(config.dtype)
        if config.shared_output_is_reduced:  # as soon as the shared experts finish, before the routed ones
            shared = k3_tail.reduce_shared(shared, config=config, axis_name=TP)
        routed = jnp.dot(expert_act, down, preferred_element_type=jnp.float32).astype(config.dtype)
        return k3_tail.latent_moe_tail(routed, shared, norm_weight, up_proj_kernel, config=config, axis_name=TP,
                                       weight_layout=weight_layout, tier=tier)

    specs = (P(None, TP), P(TP), P(None, TP), P(TP), P(), kernel_spec)
    layer_fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=specs,
                                     out_specs=P(TP) if token_sharded else P()))
    arrays = (layer.expert_act, layer.down, layer.shared_act, layer.shared_out, layer.norm_weight, kernel)
    placed = [jax.device_put(jnp.asarray(x, config.dtype), NamedSharding(mesh, spec))
              for x, spec in zip(arrays, specs, strict=True)]
    return layer_fn.lower(*placed) if lower_only else layer_fn(*placed)


def assert_close(config, y, expected):
    assert y.shape == expected.shape and y.dtype == config.dtype
    assert relative_error(y, expected) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize(("tier", "weight_layout"), [pytest.param(None, "replicated", id="selected-replicated"),
                                                     pytest.param(None, "column", id="selected-column"),
                                                     *preferred_tier_layouts()])
def test_every_tier_in_a_models_shard_map_over_a_tuple_axis(mesh, tier, weight_layout):
    layer = Layer.random(CONFIG, 5)
    y = run_layer(mesh, CONFIG, layer, tier=tier, weight_layout=weight_layout)
    assert_close(CONFIG, y, layer.reference(CONFIG))
    assert y.sharding.is_fully_replicated


@pytest.mark.parametrize(("tier", "weight_layout"), [
    pytest.param(None, "column", id="selected-column"), pytest.param("column_parallel", "column", id="column_parallel"),
    pytest.param("one_shot", "replicated", id="one_shot"), pytest.param("token_parallel", "replicated",
                                                                         id="token_parallel")])
def test_the_tail_takes_the_shared_output_reduced_early_in_a_models_shard_map(mesh, tier, weight_layout):
    """k3_tail.reduce_shared right after the shared experts, the tail on its result: one token (a one-row GEMM)
    with the column layout, five with the replicated kernel; the tiers whose schedule changes most (every tier
    takes it in the covering design, through tail_forward)."""
    config = dataclasses.replace(CONFIG, shared_output_is_reduced=True)
    layer = Layer.random(config, 1 if weight_layout == "column" else 5)
    y = run_layer(mesh, config, layer, tier=tier, weight_layout=weight_layout)
    assert_close(config, y, layer.reference(config))
    assert y.sharding.is_fully_replicated


# Every pair of T, dtype and a shared output reduced early or not.
SEQUENCE_PARALLEL_CASES = [(16, jnp.bfloat16, False), (5, jnp.bfloat16, True), (0, jnp.bfloat16, False),
                           (16, jnp.float32, True), (5, jnp.float32, False), (0, jnp.float32, True)]


@pytest.mark.parametrize(("num_tokens", "dtype", "shared_output_is_reduced"), [
    pytest.param(*case, id=f"{case[0]}-{jnp.dtype(case[1]).name}-{'shared-reduced' if case[2] else 'shared-partials'}")
    for case in SEQUENCE_PARALLEL_CASES])
def test_sequence_parallel_output_is_this_ranks_rows_of_the_padded_tokens(mesh, num_tokens, dtype,
                                                                          shared_output_is_reduced):
    """Rank k returns rows [k*T'/p, (k+1)*T'/p) of y padded to T' = padded_token_count(T, p): T = 16 two
    rows each; T = 5 and T = 0 one row each, zero where it is padding. A shared output reduced early
    arrives as each rank's rows of the (padded) sum."""
    config = dataclasses.replace(CONFIG, sequence_parallel=True, dtype=dtype,
                                 shared_output_is_reduced=shared_output_is_reduced)
    layer = Layer.random(config, num_tokens)
    y = run_layer(mesh, config, layer, weight_layout="column")
    rows = token_sharded_rows(y, config, num_tokens, P_SIZE)
    if num_tokens:
        assert relative_error(rows, layer.reference(config)) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize(
    ("changes", "num_tokens", "weight_layout"),
    [
        ({}, 1, "column"),
        ({}, 300, "column"),
        ({"use_scatter_gather": True}, 4, "column"),
        ({"selection_policy": k3_tail.selection.cost_model.CostModelPolicy("mi355x")}, 1, "replicated"),
        ({"sequence_parallel": True}, 16, "replicated"),
    ],
    ids=["overlap", "column_parallel", "scatter_gather", "model_policy", "sequence_parallel"],
)
def test_the_tier_chosen_inside_is_select_tiers(mesh, changes, num_tokens, weight_layout):
    """The program built with tier=None is the program of the tier select_tier names for the call."""
    config = dataclasses.replace(CONFIG, **changes)
    layer = Layer.random(config, num_tokens)
    decision = k3_tail.select_tier(config, num_tokens, P_SIZE, weight_layout=weight_layout, platform="cpu")
    # Compiled for this CPU: the lowered programs also hold the branches other platforms would take.
    def program(tier=None):
        compiled = run_layer(mesh, config, layer, tier=tier, weight_layout=weight_layout, lower_only=True).compile()
        # Its instructions, without what names source lines (their metadata, the stack frames' table).
        return [re.sub(r", (metadata|stack_frame_id)=(\{[^}]*\}|\d+)", "", line)
                for line in compiled.as_text().splitlines() if " = " in line]

    selected = program()
    assert selected == program(decision.tier)
    others = [tier for tier in k3_tail.Tier if tier != decision.tier and tier.supports(weight_layout, config)]
    # Lowered: two tiers may compile alike on a CPU (XLA:CPU runs a sequence-parallel schedule's collectives alike).
    lowered = run_layer(mesh, config, layer, weight_layout=weight_layout, lower_only=True).as_text()
    assert all(run_layer(mesh, config, layer, tier=tier, weight_layout=weight_layout, lower_only=True).as_text()
               != lowered for tier in others)


def test_outside_a_shard_map_is_a_value_error_naming_the_axis():
    inputs = make_inputs(CONFIG, 1, 3)
    with pytest.raises(ValueError, match=r"^axis_name: 'tp' is not a mesh axis here"):
        k3_tail.latent_moe_tail(inputs.routed[0], inputs.shared[0], inputs.norm_weight, inputs.kernel, config=CONFIG)


def per_rank_call(**overrides):
    """latent_moe_tail on 4 ranks of a 1-d mesh, each rank given the [T, X] arrays in ``overrides``."""
    mesh = make_tp_mesh(4)
    inputs = make_inputs(CONFIG, 4, 3)
    arrays = dict(routed_partial=inputs.routed[0], shared_partial=inputs.shared[0], norm_weight=inputs.norm_weight,
                  up_proj_kernel=inputs.kernel)
    options = dict(config=CONFIG, weight_layout="replicated")
    for name, value in overrides.items():
        (arrays if name in arrays else options)[name] = value
    names = [name for name, value in arrays.items() if value is not None]

    def per_rank(*values):
        return k3_tail.latent_moe_tail(**{**dict.fromkeys(arrays), **dict(zip(names, values, strict=True))},
                                       **options)

    return jax.shard_map(per_rank, mesh=mesh, in_specs=tuple(P() for _ in names), out_specs=P())(
        *(jnp.asarray(arrays[name]) for name in names))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"routed_partial": np.zeros((3, 32), np.float32)}, r"^routed_partial: expected shape \(3, 64\)"),
        ({"routed_partial": np.zeros((4, 3, 64), np.float32)}, r"^routed_partial: expected a 2-d array \[T, L\]"),
        ({"shared_partial": np.zeros((4, 97), np.float32)}, r"^shared_partial: expected shape \(3, 97\)"),
        ({"shared_partial": None}, r"^shared_partial: expected an array"),
        ({"norm_weight": np.ones(64, jnp.bfloat16)}, r"^norm_weight: expected dtype float32"),
        ({"up_proj_kernel": np.zeros((64, 97), np.float32), "weight_layout": "column"},
         r"^up_proj_kernel: expected shape \(64, 25\) \(this rank's column block"),
        ({"tier": "one_shot", "weight_layout": "column", "up_proj_kernel": np.zeros((64, 25), np.float32)},
         r"^tier: one_shot needs the whole \[L, H\] kernel"),
        ({"axis_name": ("tp", "tp")}, r"^axis_name: expected a mesh axis name or a tuple of distinct"),
        ({"config": "kimi"}, r"^config: expected a k3_tail.TailConfig"),
        ({"config": dataclasses.replace(CONFIG, shared_output_is_reduced=True, sequence_parallel=True)},
         r"^shared_partial: expected shape \(1, 97\) \(the reduced shared output's rows of this rank"),
        ({"config": dataclasses.replace(CONFIG, shared_output_is_reduced=True),
          "shared_partial": np.zeros((3, 97), jnp.bfloat16)}, r"^shared_partial: expected dtype float32"),
        ({"rank": np.array([4], np.int32)}, r"^rank: expected this rank's index in \[0, 4\) along 'tp', got 4"),
        ({"rank": np.array([-1], np.int32)}, r"^rank: expected this rank's index in \[0, 4\) along 'tp', got -1"),
    ],
    ids=["routed-width", "routed-global", "shared-rows", "shared-missing", "norm-dtype", "column-block",
         "one_shot-column", "axis-repeated", "config", "reduced-shared-rows", "reduced-shared-dtype", "rank-above",
         "rank-below"],
)
def test_bad_per_rank_input_is_a_value_error_naming_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        per_rank_call(**overrides)


@pytest.mark.parametrize(("up_proj_dtype", "shared_output_is_reduced"),
                         [(None, True), ("float8_e4m3fnuz", False)], ids=["shared-reduced", "e4m3fnuz"])
def test_module_per_rank_call_in_an_nnx_shard_map(mesh, up_proj_dtype, shared_output_is_reduced):
    """The module's parameters (FP8 values and scales too) enter the model's shard_map as each rank's blocks; with
    shared_output_is_reduced the model reduces its shared partial with the module's reduce_shared first."""
    config = dataclasses.replace(CONFIG, up_proj_dtype=up_proj_dtype, shared_output_is_reduced=shared_output_is_reduced)
    module = k3_tail.LatentMoETail(config, mesh, rngs=nnx.Rngs(0), axis_name=TP, weight_layout="column")
    inputs = make_inputs(config, P_SIZE, 5)
    state_specs = nnx.StateSharding(nnx.get_partition_spec(nnx.state(module)))

    @nnx.shard_map(mesh=mesh, in_specs=(state_specs, P(TP), P(TP)), out_specs=P())
    def layer(module, routed, shared):
        shared = module.reduce_shared(shared[0]) if shared_output_is_reduced else shared[0]
        return module.per_rank(routed[0], shared)

    y = layer(module, *(jax.device_put(x, NamedSharding(mesh, P(TP))) for x in (inputs.routed, inputs.shared)))
    kernel = np.asarray(module.up_proj_kernel[...])[:, : config.hidden_size]
    if up_proj_dtype is not None:
        kernel = k3_tail.QuantizedKernel(kernel, np.asarray(module.up_proj_scale[...])[: config.hidden_size])
    expected = reference_tail(config, dataclasses.replace(inputs, kernel=kernel,
                                                          norm_weight=np.asarray(module.norm_scale[...])))
    assert_close(config, y, expected)


@pytest.mark.parametrize("weight_layout", k3_tail.ops.columns.WEIGHT_LAYOUTS)
def test_global_api_and_module_take_a_tuple_axis(mesh, weight_layout):
    inputs = make_inputs(CONFIG, P_SIZE, 5)
    y = k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=CONFIG,
                             mesh=mesh, axis_name=TP, weight_layout=weight_layout)
    assert_close(CONFIG, y, reference_tail(CONFIG, inputs))
    module = k3_tail.LatentMoETail(CONFIG, mesh, rngs=nnx.Rngs(0), axis_name=TP, weight_layout=weight_layout)
    device = jax.devices()[0]
    assert module.tp_size == P_SIZE and module.plan(5) == k3_tail.select_tier(
        CONFIG, 5, P_SIZE, weight_layout=weight_layout, device_kind=device.device_kind, platform=device.platform)


@pytest.mark.parametrize(("sequence_parallel", "num_tokens", "expected"),
                         [(False, 16, False), (False, 12, False), (True, 16, True), (True, 12, True), (True, 0, True)])
def test_is_token_sharded_output_is_the_setting_for_every_t(sequence_parallel, num_tokens, expected):
    """With sequence_parallel the output is token-sharded whether or not p divides T (T' rows), T = 0 too."""
    config = dataclasses.replace(CONFIG, sequence_parallel=sequence_parallel)
    assert k3_tail.is_token_sharded_output(config, num_tokens, 8) is expected


@pytest.mark.parametrize(("args", "argument"), [(("config", 5, 8), "config"), ((CONFIG, -1, 8), "num_tokens"),
                                                ((CONFIG, 5, 0), "tp_size")])
def test_is_token_sharded_output_refuses_bad_arguments_naming_them(args, argument):
    with pytest.raises(ValueError, match=f"^{argument}:"):
        k3_tail.is_token_sharded_output(*args)


# --- The reduction contract, from the inputs' types ------------------------------------------------------------


def contract_call(config, *, routed_spec, shared_spec, reduce_shared_first=False, check_vma=True):
    """latent_moe_tail on 4 ranks with the routed and shared inputs placed per their specs (P("tp"): a
    per-rank partial, typed as varying; P(): one value on every rank), optionally through reduce_shared."""
    mesh = make_tp_mesh(4, jax.sharding.AxisType.Auto)
    inputs = make_inputs(CONFIG, 4, 3)

    def per_rank(routed, shared, norm_weight, kernel):
        routed = routed[0] if routed.ndim == 3 else routed
        shared = shared[0] if shared.ndim == 3 else shared
        if reduce_shared_first:
            shared = k3_tail.reduce_shared(shared, config=dataclasses.replace(CONFIG, shared_output_is_reduced=True))
        return k3_tail.latent_moe_tail(routed, shared, norm_weight, kernel, config=config)

    routed = inputs.routed if routed_spec == P("tp") else inputs.routed[0]
    shared = inputs.shared if shared_spec == P("tp") else inputs.shared[0]
    return jax.shard_map(per_rank, mesh=mesh, in_specs=(routed_spec, shared_spec, P(), P()), out_specs=P(),
                         check_vma=check_vma)(routed, shared, inputs.norm_weight, inputs.kernel)


@pytest.mark.parametrize(
    ("overrides", "routed_spec", "reduce_shared_first", "message"),
    [
        # reduce_shared's result is the same on every rank: the tail would add it p times.
        ({}, P("tp"), True, r"^shared_partial: config.shared_output_is_reduced is False, so expected this rank's "
                            r"partial, .*set TailConfig\(shared_output_is_reduced=True\)"),
        # Partials vary over the TP axis: the tail would add one rank's partial instead of their sum.
        ({"shared_output_is_reduced": True}, P("tp"), False,
         r"^shared_partial: config.shared_output_is_reduced is True, so expected the output of "
         r"k3_tail.reduce_shared, .*varies over 'tp'"),
        ({}, P(), False, r"^routed_partial: config.routed_output_is_reduced is False"),
        ({"routed_output_is_reduced": True}, P("tp"), False,
         r"^routed_partial: config.routed_output_is_reduced is True, so expected the reduced latent"),
    ],
    ids=["reduced-shared-unflagged", "shared-partials-flagged", "reduced-routed-unflagged", "routed-partials-flagged"],
)
def test_an_input_whose_type_contradicts_its_reduced_flag_is_refused_naming_the_flag(
    overrides, routed_spec, reduce_shared_first, message
):
    config = dataclasses.replace(CONFIG, **overrides)
    with pytest.raises(ValueError, match=message):
        contract_call(config, routed_spec=routed_spec, shared_spec=P("tp"), reduce_shared_first=reduce_shared_first)


def test_the_contract_holds_with_check_vma_off_where_the_types_no_longer_say_it():
    """Without variation tracking the tail cannot tell partials from sums; matching inputs still run."""
    config = dataclasses.replace(CONFIG, shared_output_is_reduced=True)
    y = contract_call(config, routed_spec=P("tp"), shared_spec=P("tp"), reduce_shared_first=True, check_vma=False)
    inputs = make_inputs(CONFIG, 4, 3)
    assert relative_error(y, reference_tail(CONFIG, inputs)) <= TOLERANCE[CONFIG.dtype]
