"""compile_tail, its abstract arguments, the library's compiler options, the shipped GPU targets, and the
deviceless ROCm topologies' stand-in runtime libraries (k3_tail.deviceless.rocm_stand_ins)."""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import ROCM_WHEELS, gpu_mesh_for, make_tp_mesh
from k3_tail import TailConfig, Tier, compile_tail, select_tier
from k3_tail.deviceless import rocm_stand_ins
from k3_tail.deviceless.topologies import GPU_TARGETS, TopologyUnavailable, parse_topology, topology_mesh
from k3_tail.hardware import HARDWARE, native_fp8_formats
from k3_tail.xla.compilation import compiler_options, tail_arguments
from k3_tail.xla.hlo_text import parse_module
from k3_tail.xla.report import report
from rocm_stand_in_helpers import PRINT_TOPOLOGY_ERROR, build_fake_plugin, needs_rocm_wheels, needs_tools, run_python

CONFIG = TailConfig(hidden_size=99, latent_size=64)


@pytest.mark.parametrize("tier", list(Tier))
def test_gpu_options_pin_what_each_tier_rests_on(tier):
    options = compiler_options(tier, "gpu")
    assert ("xla_gpu_disable_async_collectives" in options) == (tier in (Tier.OVERLAP, Tier.SCATTER_GATHER))
    assert ("xla_gpu_all_reduce_combine_threshold_bytes" in options) == (tier == Tier.OVERLAP)


@pytest.mark.parametrize("tier", list(Tier))
def test_cpu_needs_no_options(tier):
    assert compiler_options(tier, "cpu") == {}


def test_a_device_gets_the_options_of_its_platform():
    assert compiler_options(Tier.OVERLAP, jax.devices()[0]) == compiler_options(Tier.OVERLAP, "cpu")


def test_an_unknown_platform_gets_a_value_error_naming_platform_not_empty_options():
    with pytest.raises(ValueError, match="^platform: expected one of"):
        compiler_options(Tier.OVERLAP, "nvidia")


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
                        routed_output_is_reduced=True)
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


@pytest.mark.parametrize(("argument", "value"), [("config", "kimi"), ("num_tokens", -1), ("weight_layout", "rows"),
                                                 ("xla_options", [("xla_dump_to", "/tmp")]), ("xla_options", {1: 2})])
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


@pytest.mark.parametrize(("target", "preset"), [("mi300x", "mi300x"), ("mi355x", "mi355x")])
def test_a_deviceless_rocm_kind_starts_with_its_gfx_arch_and_still_names_its_gpu(target, preset):
    """jax 0.12's Pallas takes the arch from the device kind (docs/guide.md, "One GPU kernel per decode call"): the
    shipped record's description starts with its gcn arch, and the FP8 formats are still found by the GPU's name
    in it."""
    text = GPU_TARGETS[target].config_text()
    arch = re.search(r'gcn_arch_name:\s*"(gfx\w+)', text).group(1)
    kind = re.search(r'device_description_str:\s*"([^"]+)"', text).group(1)
    assert kind.startswith(arch + " ") and target.upper() in kind
    assert native_fp8_formats(kind) == HARDWARE[preset].fp8_formats


@pytest.mark.skipif(ROCM_WHEELS, reason="the ROCm plugin is installed here")
@pytest.mark.parametrize("topology", ["mi300xx8", "mi355xx8"])
def test_rocm_topologies_without_the_plugin_name_the_extra_that_brings_it(topology):
    with pytest.raises(TopologyUnavailable, match=r"jax-rocm7-pjrt and jax-rocm7-plugin not installed.*\[rocm-aot\]"):
        topology_mesh(topology)


@pytest.mark.parametrize(("topology", "kind"), [("mi300xx8", "gfx942 (AMD MI300X)"),
                                               ("mi355xx8", "gfx950 (AMD MI355X)")])
@pytest.mark.compiled
def test_rocm_meshes_have_eight_devices_of_their_kind_and_compile_an_async_all_reduce(topology, kind):
    mesh = gpu_mesh_for(topology)
    assert mesh.size == 8 and {device.device_kind for device in mesh.devices.flat} == {kind}
    assert topology_mesh(topology) == mesh  # one topology's devices are made once per process

    def body(shared, x, w):
        return jax.lax.psum(shared, "tp"), x @ w  # an all-reduce and a GEMM that does not wait for it

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P())))
    arguments = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
                 for shape, spec in (((8 * 64, 4096), P("tp")), ((64, 1024), P()), ((1024, 2048), P()))]
    lowered = program.lower(*arguments)
    result = report(lowered.compile(), shared_argument=0)
    assert [(c.kind, c.is_async) for c in result.collectives] == [("all-reduce", True)]
    assert result.gemm_flops == 2 * 64 * 1024 * 2048
    # XLA's latency hiding scheduler puts the GEMM inside the all-reduce (on jax 0.10 it is on by default for
    # CUDA only, so it is asked for here; jax 0.12 runs it for ROCm too).
    scheduled = report(lowered.compile(compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True}),
                       shared_argument=0)
    assert scheduled.overlapped is True


MAPPED_STAND_INS = """
    def mapped_stand_ins():
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "rocm-stand-ins" in line})
"""


@pytest.mark.compiled  # run in the ROCm environments too, where the ROCm wheels are installed
def test_importing_k3_tail_prints_nothing_and_loads_no_stand_in():
    result = run_python(MAPPED_STAND_INS + """
    import k3_tail
    print(mapped_stand_ins())
    """, JAX_PLATFORMS=None)
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "[]\n", result


@needs_rocm_wheels
@pytest.mark.compiled
def test_a_rocm_topology_in_a_fresh_process_prints_nothing_and_maps_the_stand_ins(tmp_path):
    """The stand-ins are loaded when a ROCm topology is asked for, not before, and nothing is logged: not the
    plugin's "No AMD GPUs were found" (its discovery is held back) nor a missing extension module. (Built into a
    cache of its own: 1.5 s.)"""
    result = run_python(MAPPED_STAND_INS + """
    import k3_tail
    before = mapped_stand_ins()
    mesh = k3_tail.topology_mesh("mi300xx8")
    print(before, len(mapped_stand_ins()), mesh.devices.flat[0].device_kind)
    """, XDG_CACHE_HOME=str(tmp_path))
    assert result.returncode == 0 and result.stderr == "", result
    assert result.stdout.startswith("[] ") and result.stdout.endswith(" gfx942 (AMD MI300X)\n")
    assert int(result.stdout.split()[1]) >= 10  # libamdhip64, libhsa-runtime64, hipBLASLt, ... (jax 0.12: 16)


@needs_rocm_wheels
@needs_tools
def test_the_plugins_stand_ins_build_into_the_cache_and_are_reused(tmp_path):
    first = rocm_stand_ins.stand_ins(root=tmp_path)
    assert first.built and first.directory.parent == tmp_path
    assert first.directory.name.startswith(rocm_stand_ins.installed_plugin().version + "-")
    assert first.libraries[0] == "libamdhip64.so.7"  # the one every other stand-in links: loaded first
    assert {"libhipblaslt.so.1", "librocblas.so.5", "librccl.so.1", "libMIOpen.so.1"} <= set(first.libraries)
    plugin = rocm_stand_ins.installed_plugin()
    for path in plugin.elf_files:  # every library a plugin file needs: a stand-in, or one this machine has
        for soname in rocm_stand_ins.read_elf(path, shutil.which("readelf")).needed:
            assert soname in first.libraries or ctypes.CDLL(soname), (path.name, soname)
    assert first.symbols > 300
    times = {path.name: path.stat().st_mtime_ns for path in first.directory.iterdir()}
    second = rocm_stand_ins.stand_ins(root=tmp_path)
    assert (second.built, second.directory, second.libraries) == (False, first.directory, first.libraries)
    assert {path.name: path.stat().st_mtime_ns for path in second.directory.iterdir()} == times
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".building-")]


@needs_rocm_wheels
@needs_tools
def test_processes_building_the_stand_ins_at_once_share_one_directory(tmp_path):
    script = f"""
    import json
    from k3_tail.deviceless import rocm_stand_ins
    built = rocm_stand_ins.stand_ins(root={str(tmp_path)!r})
    print(json.dumps([str(built.directory), built.built]))
    """
    environment = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    processes = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=environment) for _ in range(2)]
    results = [json.loads(process.communicate(timeout=300)[0]) for process in processes]
    assert len({directory for directory, _ in results}) == 1
    assert [built for _, built in results].count(True) <= 1
    assert [path.name for path in tmp_path.iterdir()] == [os.path.basename(results[0][0])]


@needs_rocm_wheels
def test_a_missing_compiler_or_readelf_is_named(tmp_path):
    """In a fresh process with an empty cache and neither gcc nor readelf on PATH (nor $CC)."""
    result = run_python(PRINT_TOPOLOGY_ERROR, PATH=str(tmp_path), CC=None, XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert result.returncode == 0 and result.stderr == "", result
    assert "a C compiler (gcc, or $CC) and readelf (GNU binutils)" in result.stdout
    assert "apt-get install gcc binutils" in result.stdout


def test_the_tools_are_found_on_path_or_named(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(rocm_stand_ins.RocmUnavailable, match=r"gcc, or \$CC\) and readelf"):
        rocm_stand_ins.find_tools()
    readelf = tmp_path / "readelf"
    readelf.write_text("#!/bin/sh\n")
    readelf.chmod(0o755)
    with pytest.raises(rocm_stand_ins.RocmUnavailable, match=r"needs a C compiler \(gcc, or \$CC\), not found"):
        rocm_stand_ins.find_tools()


def test_a_rocm_host_keeps_its_own_libraries(monkeypatch):
    """With /dev/kfd and a GPU in the KFD topology, nothing is built or loaded: jax's discovery registers the real
    plugin with the host's ROCm."""
    from jax._src import hardware_utils

    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/dev/kfd" or real_exists(path))
    monkeypatch.setattr(hardware_utils, "num_available_amd_gpus", lambda stop_at=None: 8)
    monkeypatch.setattr(rocm_stand_ins, "plugin_registered", lambda: False)
    monkeypatch.setattr(rocm_stand_ins, "stand_ins", lambda *a, **k: pytest.fail("built stand-ins on a ROCm host"))
    assert rocm_stand_ins.real_rocm_host() and rocm_stand_ins.ensure_rocm_plugin() is None


@needs_tools
def test_stand_ins_meet_an_elfs_needs_at_the_symbol_versions_it_asks_for(tmp_path):
    plugin = build_fake_plugin(tmp_path)
    with pytest.raises(OSError):
        ctypes.CDLL(str(plugin.library))  # its libraries are missing here
    built = rocm_stand_ins.stand_ins(plugin, root=tmp_path / "cache")
    assert built.built and built.libraries == ("libk3fake.so.1", "libk3plain.so.2") and built.symbols == 3
    symbols = subprocess.run(["readelf", "-W", "--dyn-syms", str(built.directory / "libk3fake.so.1")],
                             capture_output=True, text=True, check=True).stdout
    assert "k3fake_add@@K3FAKE_1.0" in symbols and "k3fake_new@@K3FAKE_2.0" in symbols
    plain = subprocess.run(["readelf", "-W", "--dyn-syms", str(built.directory / "libk3plain.so.2")],
                           capture_output=True, text=True, check=True).stdout
    assert " k3plain_hello" in plain  # an unversioned symbol goes to the library whose name it starts with
    rocm_stand_ins.preload(built)
    # Every stand-in function fails with 1: 1 + 10 * 1 + 100 * 1.
    assert ctypes.CDLL(str(plugin.library)).fake_plugin_call() == 111


@needs_tools
def test_a_changed_plugin_gets_stand_ins_of_its_own(tmp_path):
    plugin = build_fake_plugin(tmp_path)
    first = rocm_stand_ins.stand_ins(plugin, root=tmp_path / "cache")
    assert rocm_stand_ins.stand_ins(plugin, root=tmp_path / "cache").directory == first.directory
    os.utime(plugin.library, ns=(0, plugin.library.stat().st_mtime_ns + 10**9))  # a reinstalled plugin
    second = rocm_stand_ins.stand_ins(plugin, root=tmp_path / "cache")
    assert second.built and second.directory != first.directory
    assert second.directory.name.startswith("0.0.test-")
