"""The GPU kernels a compiled call launches besides its collectives and copies (XLA's thunk sequence, read by
k3_tail.xla.report from the compile's dump), at Kimi-K3 shapes on deviceless 8-GPU topologies.

Every tier's count is its record's (``Tier.X.record.gpu_kernels``, the cost model's per-kernel term) on each
target, T = 1 and 16, both layouts; the default decode call (the one_kernel tier) is ONE kernel, reads its
weight block where it lies and launches a grid that fills the device.
"""

import pytest

from helpers import compiled_report, compiled_tail, gpu_mesh_for, tier_layouts, topology_params
from k3_tail import Tier, TailConfig
from k3_tail.hardware import device_platform
from k3_tail.ops.fused_projection import TARGET_PROGRAMS

CONFIG = TailConfig.kimi_k3()
P = 8
DECODE = [1, 16]


@pytest.fixture(scope="module", params=topology_params("h100x8", "mi300xx8", "mi355xx8", "rocm"))
def target_mesh(request):
    return gpu_mesh_for(request.param, P)


@pytest.mark.parametrize("num_tokens", DECODE)
@pytest.mark.parametrize("tier, weight_layout", tier_layouts())
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
