"""compile_tail, its abstract arguments, the library's compiler options and the shipped GPU targets."""

import pytest
from jax.sharding import PartitionSpec as P

from helpers import make_tp_mesh
from k3_tail import GPU_TARGETS, Tier, TailConfig, compile_tail, compiler_options, select_tier, tail_arguments
from k3_tail.xla.hlo_text import parse_module
from k3_tail.xla.topologies import TopologyUnavailable, parse_topology, topology_mesh

CONFIG = TailConfig(hidden_size=99, latent_size=64)


@pytest.mark.parametrize("tier", list(Tier))
def test_gpu_options_pin_what_each_tier_rests_on(tier):
    options = compiler_options(tier, "gpu")
    assert ("xla_gpu_disable_async_collectives" in options) == (tier in (Tier.OVERLAP, Tier.SCATTER_GATHER))
    assert ("xla_gpu_all_reduce_combine_threshold_bytes" in options) == (tier == Tier.OVERLAP)


@pytest.mark.parametrize("tier", list(Tier))
def test_cpu_needs_no_options(tier):
    assert compiler_options(tier, "cpu") == {}


@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
def test_arguments_carry_the_shapes_and_shardings_tail_forward_places(weight_layout):
    mesh = make_tp_mesh(4)
    routed, shared, norm_weight, kernel = tail_arguments(CONFIG, mesh, 5, weight_layout=weight_layout)
    assert (routed.shape, shared.shape, norm_weight.shape) == ((4, 5, 64), (4, 5, 99), (64,))
    assert kernel.shape == ((64, 100) if weight_layout == "column" else (64, 99))
    assert routed.sharding.spec == P("tp") and shared.sharding.spec == P("tp")
    assert kernel.sharding.spec == (P(None, "tp") if weight_layout == "column" else P())


def test_arguments_follow_the_config():
    config = TailConfig(hidden_size=99, latent_size=64, has_shared_experts=False, use_latent_norm=False,
                        fused_output_is_reduced=True)
    routed, shared, norm_weight, _ = tail_arguments(config, make_tp_mesh(2), 3)
    assert routed.shape == (3, 64) and shared is None and norm_weight is None


@pytest.mark.parametrize("num_tokens", [0, 4, 300])
def test_compile_tail_without_a_tier_compiles_the_selected_one(num_tokens):
    mesh = make_tp_mesh(2)
    compiled = compile_tail(CONFIG, mesh, num_tokens)
    expected = compile_tail(CONFIG, mesh, num_tokens, tier=select_tier(CONFIG, num_tokens, 2).tier)
    def opcodes(program):
        return [instruction.opcode for instruction in parse_module(program.as_text()).entry.instructions]

    assert opcodes(compiled) == opcodes(expected)
    output = parse_module(compiled.as_text()).entry.instructions[-1]
    assert output.arrays[0].dims == (num_tokens, 99)


@pytest.mark.parametrize(("argument", "value"), [("config", "kimi"), ("num_tokens", -1), ("weight_layout", "rows")])
def test_bad_arguments_are_value_errors(argument, value):
    arguments = dict(config=CONFIG, mesh=make_tp_mesh(2), num_tokens=4)
    arguments[argument] = value
    with pytest.raises(ValueError, match=argument):
        compile_tail(**arguments)


@pytest.mark.parametrize(("name", "target", "count"), [("h100x8", "h100", 8), ("H200x4", "h200", 4),
                                                        ("mi300xx8", "mi300x", 8), ("mi355x8", "mi355x", 8)])
def test_topology_names(name, target, count):
    parsed_target, parsed_count = parse_topology(name)
    assert (parsed_target.name, parsed_count) == (target, count)


@pytest.mark.parametrize("name", ["h100", "a100x8", "h100x0", ""])
def test_bad_topology_names_are_value_errors(name):
    with pytest.raises(ValueError, match="topology"):
        parse_topology(name)


@pytest.mark.parametrize("target", sorted(GPU_TARGETS))
def test_every_target_ships_a_record_for_its_platform(target):
    text = GPU_TARGETS[target].config_text()
    platform = GPU_TARGETS[target].platform
    assert f'platform_name: "{platform.upper()}"' in text
    assert ("cuda_compute_capability" if platform == "cuda" else "gcn_arch_name") in text


def test_rocm_topologies_say_why_they_cannot_compile_without_rocm():
    try:
        topology_mesh("mi355xx8")
    except TopologyUnavailable as error:
        assert "ROCm" in str(error)
    else:
        pytest.skip("the ROCm plugin loads on this host")
