"""No collective in a ROCm graph: no program the library compiles, or tells a user to compile, for ROCm puts a
collective inside a command buffer (a HIP graph). Read from the thunk sequence of XLA's dump
(``k3_tail.xla.launches.read_thunk_sequence``) on deviceless 8 x MI300X and 8 x MI355X, jax 0.10.2 and 0.12.

Why (RCCL re-traces a collective captured in a HIP graph at every record): docs/guide.md, "ROCm graphs and
collectives". The library's options never name COLLECTIVES and XLA's default command types hold none; the last
compiled test shows that the check finds a collective XLA is told to capture.
"""

import atexit
import functools
import re
import shutil
import tempfile

import pytest

from helpers import compiled_dump, compiled_tail, gpu_mesh_for, layout_for, topology_params
from k3_tail import TailConfig, Tier, compile_tail
from k3_tail.models.kimi_k3 import LayerConfig, layer as layer_module
from k3_tail.xla.compilation import compiler_options
from k3_tail.xla.hlo_text import parse_module
from k3_tail.xla.launches import collectives_in_command_buffers, read_thunk_sequence
from lab import acceptance

CONFIG = TailConfig.kimi_k3()
P = 8
DECODE = [1, 16]
LAYER = LayerConfig.kimi_k3()
COMMAND_BUFFER_OPTION = "xla_gpu_enable_command_buffer"
# XLA's default command types, with graphs from one command on (XLA's default: runs of 5 or more).
SMALLEST_GRAPHS = {"xla_gpu_graph_min_graph_size": 1}
# What no option of the library says: capture collectives too.
CAPTURING_COLLECTIVES = {**SMALLEST_GRAPHS, COMMAND_BUFFER_OPTION: "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,COLLECTIVES"}
# A thunk sequence in the form of XLA's dump (jax 0.10.2 and 0.12), cut down: a command buffer, an async all-reduce,
# a loop whose body is a graph holding an all-gather, and the all-reduce's done.
SEQUENCE = """\
000: kCommandBuffer [source       | next=009 (1) ]
    001: kCustomKernel [source | sink] gemm_fusion_dot_5 grid: [384, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
009: kAsyncStart    [prev=000 (1) | next=041 (2) ] stream=communication_stream[0], async_id=9
    008: kAllReduce [source | sink] kAllReduce
027: kWhile         [prev=000 (1) | next=041 (1) ]
condition:
    028: kCustomKernel [source | sink] wrapped_compare grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer [source | sink]
        029: kCustomKernel [source       | next=030 (1)] input_reduce_fusion grid: [1, 1, 1] threads: [8, 1, 1]
        030: kAllGather    [prev=029 (1) | sink        ] kAllGather
041: kAsyncDone     [prev=027 (1) | sink         ] async_id=9
"""


@pytest.fixture(scope="module", params=topology_params("mi300xx8", "mi355xx8", "rocm"))
def rocm_mesh(request):
    return gpu_mesh_for(request.param, P)


@functools.cache
def _dump_root():
    root = tempfile.mkdtemp(prefix="k3_tail_test_graphs_")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def fresh_dump_dir():
    return tempfile.mkdtemp(dir=_dump_root())


def collective_kinds(compiled, dump_dir):
    """(the kinds of the collective thunks outside command buffers, those of the ones inside)."""
    module_name = parse_module(compiled.as_text()).name
    inside = [thunk.kind for thunk in collectives_in_command_buffers(dump_dir, module_name)]
    outside = [thunk.kind for thunk in read_thunk_sequence(dump_dir, module_name)
               if thunk.is_collective and not thunk.in_command_buffer]
    return outside, inside


def command_buffer_count(compiled, dump_dir):
    module_name = parse_module(compiled.as_text()).name
    return sum(thunk.kind == "kCommandBuffer" for thunk in read_thunk_sequence(dump_dir, module_name))


@functools.cache
def tail_with_options(mesh, num_tokens, tier, options):
    """(compile_tail's program with the per-executable ``options`` (a tuple of pairs) over the library's, its dump)."""
    dump_dir = fresh_dump_dir()
    compiled = compile_tail(CONFIG, mesh, num_tokens, tier=tier, weight_layout="column", dump_to=dump_dir,
                            xla_options=dict(options))
    return compiled, dump_dir


@functools.cache
def example_layer(mesh, num_tokens):
    """(the example layer compiled as compile_layer compiles it, with the options it tells a user to use; its dump)."""
    dump_dir = fresh_dump_dir()
    return layer_module.compile_layer(LAYER, mesh, num_tokens, xla_options={"xla_dump_to": dump_dir}), dump_dir


def test_the_thunk_sequence_says_which_collectives_a_command_buffer_runs(tmp_path):
    """Nesting by indentation (a loop's body included); an async start and done around a collective are one."""
    (tmp_path / "module_0001.jit_f.thunk_sequence_after_thunk_passes.txt").write_text(SEQUENCE)
    thunks = read_thunk_sequence(tmp_path, "jit_f")
    assert [(thunk.kind, thunk.enclosing) for thunk in thunks if thunk.is_collective] == [
        ("kAsyncStart", ()), ("kAllReduce", ("kAsyncStart",)), ("kAllGather", ("kWhile", "kCommandBuffer")),
        ("kAsyncDone", ())]
    assert [thunk.kind for thunk in collectives_in_command_buffers(tmp_path, "jit_f")] == ["kAllGather"]


def test_no_option_of_the_library_names_collectives_as_a_command_type():
    """Every tier's ROCm options, the acceptance run's modes and the example layer's GPU options."""
    option_sets = {f"tier {tier.value}": compiler_options(tier, "rocm") for tier in Tier}
    option_sets |= {f"acceptance mode {mode}": acceptance.MODE_OPTIONS[mode] for mode in acceptance.MODES}
    option_sets["example layer"] = layer_module.GPU_COMPILER_OPTIONS
    naming = {name: options[COMMAND_BUFFER_OPTION] for name, options in option_sets.items()
              if re.search("COLLECTIVE", str(options.get(COMMAND_BUFFER_OPTION, "")), re.IGNORECASE)}
    assert not naming


@pytest.mark.parametrize("num_tokens", DECODE)
def test_the_default_tail_call_runs_its_collectives_outside_command_buffers(rocm_mesh, num_tokens):
    compiled = compiled_tail(CONFIG, rocm_mesh, num_tokens, None, "column")
    outside, inside = collective_kinds(compiled, compiled_dump(CONFIG, rocm_mesh, num_tokens, None, "column"))
    assert outside and not inside, (outside, inside)


@pytest.mark.parametrize("tier", [pytest.param(tier, id=tier.value) for tier in Tier])
def test_every_tier_runs_its_collectives_outside_command_buffers(rocm_mesh, tier):
    """At T = 16, in the column layout where the tier takes it."""
    layout = layout_for(tier)
    compiled = compiled_tail(CONFIG, rocm_mesh, 16, tier, layout)
    outside, inside = collective_kinds(compiled, compiled_dump(CONFIG, rocm_mesh, 16, tier, layout))
    assert outside and not inside, (outside, inside)


@pytest.mark.parametrize("tier", [pytest.param(None, id="selected"), pytest.param(Tier.OVERLAP, id="overlap")])
def test_xla_default_command_types_capture_no_collective(rocm_mesh, tier):
    """With graphs of any size, as a model's larger program gets them: graphs form, collectives stay out."""
    compiled, dump_dir = tail_with_options(rocm_mesh, 16, tier, tuple(SMALLEST_GRAPHS.items()))
    outside, inside = collective_kinds(compiled, dump_dir)
    assert command_buffer_count(compiled, dump_dir) > 0
    assert outside and not inside, (outside, inside)


def test_the_acceptance_runs_graph_mode_captures_no_collective(rocm_mesh):
    """The "command_buffers" mode makes the checked call one graph (T = 16, the kernel in the config's dtype)."""
    dump_dir = fresh_dump_dir()
    case = acceptance.Case(16, CONFIG.dtype.name)
    compiled, command_buffers = acceptance.compile_check(case, "command_buffers", rocm_mesh, config=CONFIG, seed=0,
                                                         oracle=acceptance.serial_split_oracle, dump_to=dump_dir)
    assert command_buffers >= 1
    assert collective_kinds(compiled, dump_dir)[1] == []


def test_the_acceptance_runs_graph_options_leave_a_tail_calls_collectives_outside(rocm_mesh):
    """The checked call has no collective of its own; the mode's options on the default tail call at T = 16 (its
    all-reduces between fusions and the kernel) form graphs around them."""
    options = tuple(acceptance.MODE_OPTIONS["command_buffers"].items())
    compiled, dump_dir = tail_with_options(rocm_mesh, 16, None, options)
    outside, inside = collective_kinds(compiled, dump_dir)
    assert command_buffer_count(compiled, dump_dir) > 0
    assert outside and not inside, (outside, inside)


@pytest.mark.parametrize("num_tokens", [16, 2048])
def test_the_example_layer_runs_its_collectives_outside_command_buffers(rocm_mesh, num_tokens):
    """Kimi-K3's widths, 8 experts, top 2: a decode and a prefill call."""
    outside, inside = collective_kinds(*example_layer(rocm_mesh, num_tokens))
    assert outside and not inside, (outside, inside)


def test_the_check_finds_a_collective_that_xla_is_told_to_capture(rocm_mesh):
    """COLLECTIVES among the command types (what the library never says): the all-reduces go into the graph."""
    compiled, dump_dir = tail_with_options(rocm_mesh, 16, None, tuple(CAPTURING_COLLECTIVES.items()))
    assert "kAllReduce" in collective_kinds(compiled, dump_dir)[1]
