"""The GPU kernels a compiled call launches besides its collectives and copies (XLA's thunk sequence, read by
k3_tail.xla.report from the compile's dump), at Kimi-K3 shapes on deviceless 8-GPU topologies.

Every tier's count is its record's (``Tier.X.record.gpu_kernels``, the cost model's per-kernel term) on each
target, every pair of tier, layout and T = 1 or 16 (the whole product with ``slow``); the default decode call (the
one_kernel tier) is ONE kernel, reads its weight block where it lies and launches a grid that fills the device.
"""

import atexit
import functools
import shutil
import tempfile

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import k3_tail
from helpers import compiled_report, compiled_tail, gpu_mesh_for, pairwise_params, tier_supports_layout, topology_params
from k3_tail import TailConfig, Tier, padded_hidden_size
from k3_tail.hardware import device_platform
from k3_tail.ops.fused_launch import TARGET_PROGRAMS

CONFIG = TailConfig.kimi_k3()
P = 8
DECODE = [1, 16]


@pytest.fixture(scope="module", params=topology_params("h100x8", "mi300xx8", "mi355xx8", "rocm"))
def target_mesh(request):
    return gpu_mesh_for(request.param, P)


def each_tier_case_id(values):
    tier, weight_layout, num_tokens = values
    return f"{tier.value}-{weight_layout}-{num_tokens}"


# Every pair of tier, layout and decode T (each tier at both T and with each layout it runs); the whole product with
# ``pytest -m slow``.
EACH_TIER_CASES = pairwise_params({"tier": tuple(Tier), "weight_layout": ("column", "replicated"),
                                   "num_tokens": tuple(DECODE)}, each_tier_case_id, tier_supports_layout)


@pytest.mark.parametrize("tier, weight_layout, num_tokens", EACH_TIER_CASES)
def test_each_tier_launches_the_kernels_its_record_counts(target_mesh, tier, weight_layout, num_tokens):
    result = compiled_report(CONFIG, target_mesh, num_tokens, tier, weight_layout)
    platform = device_platform(target_mesh.devices.flat[0])
    expected = tier.record.gpu_kernels.of(platform, weight_layout, num_tokens)
    assert result.gpu_kernel_count == expected, result.gpu_kernels


@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
@pytest.mark.parametrize("num_tokens", DECODE)
def test_the_default_decode_call_is_one_gpu_kernel_besides_its_collectives(target_mesh, num_tokens, weight_layout):
    """compile_tail's program for the tier select_tier picks: one_kernel, one kernel, two all-reduces."""
    result = compiled_report(CONFIG, target_mesh, num_tokens, None, weight_layout)
    assert result.gpu_kernel_count == 1
    assert [c.kind for c in result.collectives] == ["all-reduce", "all-reduce"]
    assert [gemm.scopes for gemm in result.gemms] == [("up_projection",)]


@pytest.mark.parametrize("num_tokens", DECODE)
def test_one_kernel_reads_its_block_where_it_lies_and_fills_the_device(target_mesh, num_tokens):
    """No copy of the [L, H/p] block (6.4 MB): temporaries at T = 1 at most 2 MB, as the other column tiers
    (the kernel's partials and counters); a grid of at least TARGET_PROGRAMS workgroups (AMD asks MI300X for
    about 1024); its GEMM FLOPs those of its own block."""
    compiled = compiled_tail(CONFIG, target_mesh, num_tokens, Tier.ONE_KERNEL, "column")
    if num_tokens == 1:
        assert compiled.memory_analysis().temp_size_in_bytes <= 2e6
    (gemm,) = compiled_report(CONFIG, target_mesh, num_tokens, Tier.ONE_KERNEL, "column").gemms
    x, y, z = gemm.grid
    assert x * y * z >= TARGET_PROGRAMS
    assert gemm.flops == 2 * num_tokens * CONFIG.latent_size * CONFIG.hidden_size // P


@functools.cache
def model_pattern_report(mesh, num_tokens, pass_rank):
    """The XlaReport (GPU kernels included) of the README's model pattern: the tail inside a model's own
    jax.shard_map over ``mesh``, its rank passed (``rank=``, the block of arange(p)) or found by the tail."""
    config, p = CONFIG, mesh.shape["tp"]
    hidden, latent = config.hidden_size, config.latent_size
    ranks, replicated, columns = PartitionSpec("tp"), PartitionSpec(), PartitionSpec(None, "tp")

    def layer(routed, shared, norm_weight, kernel, rank):
        return k3_tail.latent_moe_tail(routed[0], shared[0], norm_weight, kernel, config=config, axis_name="tp",
                                       weight_layout="column", rank=rank if pass_rank else None,
                                       device=mesh.devices.flat[0])

    def spec(shape, dtype, partition):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, partition))

    arguments = (spec((p, num_tokens, latent), config.dtype, ranks), spec((p, num_tokens, hidden), config.dtype, ranks),
                 spec((latent,), config.dtype, replicated),
                 spec((latent, padded_hidden_size(hidden, p)), config.dtype, columns), spec((p,), jnp.int32, ranks))
    mapped = jax.shard_map(layer, mesh=mesh, out_specs=replicated,
                           in_specs=(ranks, ranks, replicated, columns, ranks))
    dump_dir = tempfile.mkdtemp(prefix="k3_tail_test_pattern_")
    atexit.register(shutil.rmtree, dump_dir, ignore_errors=True)
    compiled = jax.jit(mapped).lower(*arguments).compile(compiler_options={"xla_dump_to": dump_dir})
    return k3_tail.xla.report.report(compiled, dump_dir=dump_dir)


# What rank= saves (the partition id's convert) is the same at every T: T = 16 repeats T = 1 (with ``pytest -m slow``).
@pytest.mark.parametrize("num_tokens", [1, pytest.param(16, marks=pytest.mark.slow)])
def test_the_readme_model_pattern_is_one_gpu_kernel_with_its_rank_passed(target_mesh, num_tokens):
    """latent_moe_tail inside a model's shard_map with rank=: one kernel; without it the partition id's convert
    adds a second (what the README says of rank=)."""
    assert model_pattern_report(target_mesh, num_tokens, True).gpu_kernel_count == 1
    assert model_pattern_report(target_mesh, num_tokens, False).gpu_kernel_count == 2
