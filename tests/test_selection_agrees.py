"""select_tier names the tier the compiled call takes on each deviceless 8-GPU target, given a device of the mesh or
JAX's own platform name for it, "gpu": at decode (T = 1 and 16: one_kernel) and at prefill (T = 1024), both layouts;
and the example layer compiles with the options of the tier its tail takes.

The call's tier is read from its program: ``compile_tail`` without a tier compiles the call as every entry point
runs it (the tier chosen for the mesh's devices), and that program is, instruction for instruction, the one
compiled with select_tier's tier forced (their metadata, which holds the callers' source lines, left out).
"""

import re

import pytest

import k3_tail
from helpers import compiled_tail, gpu_mesh_for, topology_params
from k3_tail import Tier
from k3_tail.models.kimi_k3 import KIMI_K3_NUM_EXPERTS, KIMI_K3_TOP_K, LayerConfig, layer as layer_module
from k3_tail.xla.compilation import compiler_options

CONFIG = k3_tail.TailConfig.kimi_k3()
P = 8
# The tables of source locations that the instructions' metadata refers to, and their rows.
_SOURCE_TABLES = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames|\d+ .*)$")


@pytest.fixture(scope="module", params=topology_params("h100x8", "mi300xx8", "mi355xx8"))
def target_mesh(request):
    return gpu_mesh_for(request.param, P)


def instructions(compiled):
    """The compiled module's text without the instructions' metadata and the source tables it refers to."""
    text = re.sub(r", metadata=\{[^{}]*\}", "", compiled.as_text())
    return [line for line in text.splitlines() if not _SOURCE_TABLES.match(line)]


@pytest.mark.parametrize("weight_layout", ["column", "replicated"])
@pytest.mark.parametrize("num_tokens", [1, 16, 1024])
@pytest.mark.parametrize("given", ["device", "gpu"])
def test_select_tier_names_the_tier_the_compiled_call_takes(target_mesh, given, num_tokens, weight_layout):
    device = target_mesh.devices.flat[0]
    decision = k3_tail.select_tier(CONFIG, num_tokens, P, weight_layout=weight_layout, device_kind=device.device_kind,
                                   platform=device if given == "device" else given)
    taken = compiled_tail(CONFIG, target_mesh, num_tokens, None, weight_layout)
    named = compiled_tail(CONFIG, target_mesh, num_tokens, decision.tier, weight_layout)
    assert instructions(taken) == instructions(named), decision


@pytest.mark.parametrize("num_tokens", [1, CONFIG.one_kernel_max_tokens])
def test_decode_on_a_gpu_is_one_kernel_whichever_way_the_platform_is_given(target_mesh, num_tokens):
    """What the test above holds the compiled call to, named: JAX's "gpu" no longer answers overlap."""
    device = target_mesh.devices.flat[0]
    for platform in (device, device.platform):
        assert k3_tail.select_tier(CONFIG, num_tokens, P, weight_layout="column", platform=platform).tier \
            is Tier.ONE_KERNEL


@pytest.mark.parametrize("num_tokens", [1, 16, 1024])
def test_the_example_layer_compiles_with_the_options_of_the_tier_its_tail_takes(target_mesh, num_tokens):
    config = LayerConfig.kimi_k3(num_experts=KIMI_K3_NUM_EXPERTS, top_k=KIMI_K3_TOP_K)
    device = target_mesh.devices.flat[0]
    tier = k3_tail.select_tier(config.tail, num_tokens, P, weight_layout="replicated",
                               device_kind=device.device_kind, platform=device).tier
    expected = {**compiler_options(tier, device), **layer_module.GPU_COMPILER_OPTIONS}
    assert layer_module.layer_compiler_options(config, target_mesh, num_tokens) == expected
