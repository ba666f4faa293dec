"""The routed-expert methods of k3_tail/models/kimi_k3/routed_experts.py: exact for any routing, and what they
cost in the Kimi-K3 layer compiled for a deviceless 8 x H100.

Parity: every method, per rank under ``jax.shard_map`` on 2 CPU devices (each expert's intermediate
width split over them, the ranks' partials summed), against the float64 per-pair loop of
k3_tail/models/kimi_k3/reference.py, in float32 at tiny widths (L 32, m 16, 8 experts): relative
Frobenius error <= 1e-5 (float32 accumulation; measured up to 2.6e-7). Routings: random distinct
experts, every token to the same two experts (far over the capacity method's C, so it runs overflow
rounds), top_k = E, tied router scores (through the layer's own router), and no tokens.

Cost: the whole layer at Kimi-K3's shapes (896 experts, top 16, bf16, the tail tier it selects),
compiled once per topology and T for a deviceless GPU topology (``helpers.gpu_mesh_for``: 8 x H100 with the
``[aot]`` extra, 8 x MI300X and 8 x MI355X with the ``[rocm-aot]`` one; each skipped where it cannot
compile). Prefill (T = 256, 2048, and 8192 with ``slow``; H100): GEMM FLOPs per device at most 1.5 times the
layer's useful FLOPs (k3_tail.models.kimi_k3.cost and the tier's up projection) and temp memory at most 8 GB. Decode
(T = 1, 16; every topology): temp memory at most a quarter of the routed-expert weight bytes the step
reads, so no copy of the gathered weight blocks, nor a float32 copy of a one-row product's kernel
(k3_tail/models/kimi_k3/gemm.py), exists.

Schedule: in the same programs (the layer's default ``early_shared_reduction=True``), the shared reduction is an
async pair that starts before any routed-expert weight is read and waits only after the last routed-expert
instruction (k3_tail.models.kimi_k3.schedule), at T = 1, 16, 256 and 2048 on every topology (2048: where jax
0.10.2's ROCm pipeline, without the latency-hiding scheduler the layer asks for, started it after all routed
work); at 16 the start is known to miss where XLA's latency-hiding scheduler starts it after the first
routed-expert fusion (H100, and MI300X / MI355X from jax 0.12).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import k3_tail
from helpers import FAST_COMPILE_OPTIONS, gpu_mesh_for, kimi_layer_compiled, make_tp_mesh, topology_params
from k3_tail.models.kimi_k3 import KIMI_K3_NUM_EXPERTS, KIMI_K3_TOP_K, LayerConfig, cost as layer_cost, routed_experts
from k3_tail.models.kimi_k3.per_rank import route
from k3_tail.models.kimi_k3.reference import reference_routed_experts
from k3_tail.models.kimi_k3.schedule import SharedReductionPlacement
from reference import relative_error

LATENT, EXPERT_WIDTH, EXPERTS, TOP_K, TP_SIZE = 32, 16, 8, 2, 2
FLOAT32_TOLERANCE = 1e-5
METHODS = tuple(routed_experts.ROUTED_EXPERTS)
DECODE_TOKENS = (1, 16)
# The prefill counts: 8192 takes 2048's route (the capacity method, the column_parallel tail) at four times the rows,
# one more compile of the whole layer for no other path: the full set with ``pytest -m slow``.
PREFILL_TOKENS = (256, 2048, pytest.param(8192, marks=pytest.mark.slow))
MAX_FLOPS_OVER_USEFUL, MAX_PREFILL_TEMP_BYTES, MAX_DECODE_TEMP_OVER_WEIGHTS_READ = 1.5, 8e9, 0.25
KIMI = LayerConfig.kimi_k3(num_experts=KIMI_K3_NUM_EXPERTS, top_k=KIMI_K3_TOP_K)
# The deviceless 8-GPU topologies the layer compiles for: the decode and schedule tests take every one, the
# prefill tests H100's.
LAYER_TOPOLOGIES = ("h100x8", "mi300xx8", "mi355xx8")


def expert_weights(num_experts=EXPERTS):
    """Whole experts (gate, up [E, L, m], down [E, m, L]) in float32, variance 1 / fan-in."""
    rng = np.random.default_rng(1)
    gate_up, down = (num_experts, LATENT, EXPERT_WIDTH), (num_experts, EXPERT_WIDTH, LATENT)
    shapes = (gate_up, gate_up, down)
    return tuple((rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32) for shape in shapes)


def random_routing(num_tokens, top_k=TOP_K):
    """(chosen [T, k] distinct experts per token, combine [T, k] summing to 1) drawn at random."""
    rng = np.random.default_rng(num_tokens)
    chosen = np.argsort(rng.random((num_tokens, EXPERTS)), axis=1)[:, :top_k].astype(np.int32)
    combine = rng.random((num_tokens, top_k)).astype(np.float32) + 0.5
    return chosen, combine / combine.sum(axis=1, keepdims=True)


def same_experts_routing(num_tokens):
    """Every token to experts 3 and 5: each gets T pairs, far above the capacity method's C."""
    chosen = np.tile(np.array([[3, 5]], np.int32), (num_tokens, 1))
    return chosen, np.full((num_tokens, TOP_K), 0.5, np.float32)


def tied_scores_routing(num_tokens):
    """The layer's router on a zero kernel and bias: every score ties at sigmoid(0)."""
    jitted_route = jax.jit(route, static_argnames="top_k", compiler_options=FAST_COMPILE_OPTIONS)
    chosen, combine = jitted_route(np.ones((num_tokens, 4), np.float32), np.zeros((4, EXPERTS), np.float32),
                                   np.zeros(EXPERTS, np.float32), top_k=TOP_K)
    return np.asarray(chosen), np.asarray(combine)


ROUTINGS = {
    "random": lambda: random_routing(13),
    "same-experts": lambda: same_experts_routing(40),
    "top-k-equals-e": lambda: random_routing(5, top_k=EXPERTS),
    "tied-scores": lambda: tied_scores_routing(6),
}


@functools.cache
def method_on_ranks(method):
    """``method`` per rank under jax.shard_map on TP_SIZE CPU devices, jitted: (latent, chosen, combine, gate,
    up, down) of whole experts -> the ranks' partials [p, T, L]."""
    experts = routed_experts.ROUTED_EXPERTS[method]

    def per_rank(latent, chosen, combine, gate, up, down):
        return experts(latent, chosen, combine, gate, up, down)[None]

    blocks = (P(None, None, "tp"), P(None, None, "tp"), P(None, "tp", None))
    mesh = make_tp_mesh(TP_SIZE, jax.sharding.AxisType.Auto)  # places the host arrays as in_specs say
    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(), P(), *blocks),
                                 out_specs=P("tp")), compiler_options=FAST_COMPILE_OPTIONS)


def routed_output(method, chosen, combine, weights):
    """The ranks' partials of ``method`` summed, float64 [T, L], for random latent rows of ``chosen``'s T."""
    latent = np.random.default_rng(2).standard_normal((chosen.shape[0], LATENT)).astype(np.float32)
    partials = method_on_ranks(method)(latent, chosen, combine, *weights)
    assert partials.shape == (TP_SIZE, chosen.shape[0], LATENT) and partials.dtype == jnp.float32
    return np.asarray(partials, np.float64).sum(axis=0), latent


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_matches_the_float64_per_pair_loop(method, routing):
    chosen, combine = ROUTINGS[routing]()
    num_experts = chosen.shape[1] if routing == "top-k-equals-e" else EXPERTS
    weights = expert_weights(num_experts)
    routed, latent = routed_output(method, chosen, combine, weights)
    assert relative_error(routed, reference_routed_experts(latent, chosen, combine, *weights)) <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("method", METHODS)
def test_every_method_returns_an_empty_partial_for_no_tokens(method):
    routed, _ = routed_output(method, np.zeros((0, TOP_K), np.int32), np.zeros((0, TOP_K), np.float32),
                              expert_weights())
    assert routed.shape == (0, LATENT)


def test_the_same_experts_routing_is_far_over_capacity():
    """What makes that routing adversarial for the capacity method: many overflow rounds."""
    assert routed_experts.expert_capacity(40, TOP_K, EXPERTS) == 13  # so each expert's 40 pairs make 4 chunks
    assert routed_experts.overflow_slots(EXPERTS) == 1              # and 6 overflow chunks take 6 rounds


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "capacity"),
                         [(1, 2, 8, 1), (40, 2, 8, 13), (5, 8, 8, 5), (8192, 16, 896, 183)])
def test_capacity_is_the_capacity_factor_times_the_mean_pairs_per_expert_rounded_up_at_most_t(
        num_tokens, top_k, num_experts, capacity):
    assert routed_experts.expert_capacity(num_tokens, top_k, num_experts) == capacity


@pytest.mark.parametrize(("num_tokens", "method"), [(0, "gather"), (1, "gather"), (4, "gather"), (5, "capacity"),
                                                     (300, "capacity")])
def test_the_layer_gathers_while_t_times_k_is_at_most_e_then_dispatches_by_capacity(num_tokens, method):
    config = LayerConfig(k3_tail.TailConfig(hidden_size=64, latent_size=LATENT), num_experts=EXPERTS,
                         top_k=TOP_K)
    choice = routed_experts.routed_expert_method(config, num_tokens)
    assert choice.method == method
    assert f"T*k = {num_tokens * TOP_K}" in choice.reason


@pytest.mark.parametrize("num_tokens", [-1, 2.0, True])
def test_a_token_count_that_is_not_a_count_is_a_value_error_naming_it(num_tokens):
    config = LayerConfig(k3_tail.TailConfig(hidden_size=64, latent_size=LATENT))
    with pytest.raises(ValueError, match=r"^num_tokens: expected an integer >= 0"):
        routed_experts.routed_expert_method(config, num_tokens)


@pytest.fixture
def kimi_layer_cost(tmp_path_factory):
    """(topology, T) -> {"tp_size", "gemm_flops", "useful_flops", "temp_bytes", "placement"} per device of the
    Kimi-K3 layer compiled for that deviceless topology with the tail tier it selects (compiled as
    scripts/kimi_k3_layer_share.py compiles it: ``helpers.kimi_layer_compiled``, once per session)."""

    def cost(topology, num_tokens):
        compiled = kimi_layer_compiled(tmp_path_factory, topology, num_tokens)
        mesh = gpu_mesh_for(topology)
        tp_size, device = mesh.shape["tp"], mesh.devices.flat[0]
        tier = k3_tail.select_tier(KIMI.tail, num_tokens, tp_size, device_kind=device.device_kind,
                                   platform=device).tier
        return {"tp_size": tp_size, "gemm_flops": compiled["gemm_flops"],
                "useful_flops": layer_cost.layer_flops(KIMI.sizes, num_tokens, tp_size, tier=tier),
                "temp_bytes": compiled["figures"]["temp_bytes"], "placement": compiled["placement"]}

    return cost


@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8", "mi355xx8", slow=("mi355xx8",)))
@pytest.mark.parametrize("num_tokens", PREFILL_TOKENS)
def test_prefill_layer_compiles_to_at_most_one_and_a_half_times_its_useful_flops(kimi_layer_cost, num_tokens,
                                                                                  topology):
    cost = kimi_layer_cost(topology, num_tokens)
    assert cost["gemm_flops"] <= MAX_FLOPS_OVER_USEFUL * cost["useful_flops"]


@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8", "mi355xx8", slow=("mi355xx8",)))
@pytest.mark.parametrize("num_tokens", PREFILL_TOKENS)
def test_prefill_layer_needs_at_most_8_gb_of_temp_memory(kimi_layer_cost, num_tokens, topology):
    assert kimi_layer_cost(topology, num_tokens)["temp_bytes"] <= MAX_PREFILL_TEMP_BYTES


@pytest.mark.parametrize("topology", topology_params(*LAYER_TOPOLOGIES))
@pytest.mark.parametrize("num_tokens", DECODE_TOKENS)
def test_decode_layer_copies_no_gathered_weights(kimi_layer_cost, num_tokens, topology):
    """Temp memory at most a quarter of the routed-expert weights the step reads (3 kernels of L x m/p per
    expert, times the expected distinct experts of k3_tail.models.kimi_k3.cost): no copy of the gathered
    blocks, and none of a kernel that a one-row product would make (on ROCm, float32 copies of the shared
    experts' kernels: 44 MB at T = 1, a third of the 132 MB read, before k3_tail/models/kimi_k3/gemm.py)."""
    cost = kimi_layer_cost(topology, num_tokens)
    block_bytes = 3 * KIMI.latent_size * (KIMI.expert_intermediate_size // cost["tp_size"]) * KIMI.dtype.itemsize
    weights_read = block_bytes * layer_cost.experts_read(KIMI.sizes, num_tokens)
    assert cost["temp_bytes"] <= MAX_DECODE_TEMP_OVER_WEIGHTS_READ * weights_read


# --- The shared reduction issued before the routed experts (LayerConfig.early_shared_reduction) -------------------

SCHEDULE_TOKENS = (1, 16, 256, 2048)  # gather, gather, capacity, capacity with the column_parallel tail


def placement(kimi_layer_cost, topology, num_tokens):
    """The compiled layer's SharedReductionPlacement (stored as JSON by the session's compile)."""
    facts = kimi_layer_cost(topology, num_tokens)["placement"]
    return SharedReductionPlacement(**{**facts, "routed_positions": tuple(facts["routed_positions"])})


@pytest.mark.parametrize("topology", topology_params(*LAYER_TOPOLOGIES))
@pytest.mark.parametrize("num_tokens", SCHEDULE_TOKENS)
def test_the_shared_reduction_waits_only_after_every_routed_expert_instruction(kimi_layer_cost, num_tokens,
                                                                               topology):
    """An async start/done pair whose done comes after the last routed-expert instruction that feeds the latent
    reduction (without the early reduction it starts after all of them:
    docs/measurements/2026-12-01-early-shared-reduction.md)."""
    where = placement(kimi_layer_cost, topology, num_tokens)
    assert where.is_async and where.ends_after_the_routed_experts and where.done < where.latent_reduction_start


@pytest.mark.parametrize("topology", topology_params(*LAYER_TOPOLOGIES))
@pytest.mark.parametrize("num_tokens", SCHEDULE_TOKENS)
def test_the_shared_reduction_starts_before_the_routed_experts_read_a_weight(kimi_layer_cost, num_tokens, topology):
    """So every routed-expert instruction runs while it is in flight. (Before the decode's experts were two
    kernels, XLA's latency-hiding scheduler started it after the first gathered-product fusion at T = 16.)"""
    where = placement(kimi_layer_cost, topology, num_tokens)
    assert where.starts_before_the_routed_experts
    assert where.routed_share_inside == 1.0
