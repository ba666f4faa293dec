"""The split-K kernel's memory ordering, read from the machine code the compilers emit for it (AMDGCN from the
ROCm executable's code object, SASS from the CUDA one's cubin and PTX from XLA's dump), at Kimi-K3's p = 8 on
deviceless 8 x H100, MI300X and MI355X, T = 1, 16 and 64 (the tier's tile at its largest).

Each program (r, j, s) stores its slab's partial and exponent, counts them on the tile's counter with an
acquire-release atomic at GPU scope, and the last program loads the S partials. That is correct when every
store of a program is released before its count and every load of the last program follows an acquire:

- AMD (AMDGPU memory model): a release (``buffer_wbl2`` then ``s_waitcnt vmcnt(0)``) or an acquire
  (``s_waitcnt vmcnt(0)`` then ``buffer_inv``) orders the wavefront that executes it, so every wavefront that
  stores or loads partials executes its own; the kernel's programs are one wavefront each.
- NVIDIA (PTX): ``bar.sync`` makes the CTA's stores precede thread 0's release (cumulativity), the atomic is
  acquire-release at GPU scope (SASS: ``MEMBAR.ALL.GPU``, ``ATOMG...STRONG.GPU``, then ``CCTL.IVALL``, the L1
  invalidated), and ``bar.sync`` orders the CTA's loads after the acquire.

Without the disassembler (``llvm-objdump`` of LLVM 22, ``nvdisasm``) the tests skip with the command that
installs it; under CI (``CI`` set) they fail instead.
"""

import atexit
import functools
import re
import shutil
import tempfile
from pathlib import Path

import pytest

import k3_tail
import machine_code
from helpers import disassembled, gpu_mesh_for, topology_params
from k3_tail import TailConfig, Tier
from k3_tail.hardware import device_platform

pytestmark = pytest.mark.compiled

CONFIG = TailConfig.kimi_k3()
P = 8
KERNEL = "k3_tail_norm_project_add"
TOKEN_COUNTS = [1, 16, 64]
# XLA's default LLVM optimisation level, which the suite's fast compiles lower to 0 (helpers.FAST_COMPILE_OPTIONS):
# the code read is the code users run.
USERS_OPTIMIZATION = {"xla_backend_optimization_level": 2}


@pytest.fixture(scope="module", params=topology_params("h100x8", "mi300xx8", "mi355xx8"))
def target_mesh(request):
    return gpu_mesh_for(request.param, P)


@functools.cache
def users_compile(mesh, num_tokens):
    """(one_kernel's compiled call as users compile it, the directory of XLA's dump of it)."""
    dump_dir = tempfile.mkdtemp(prefix="k3_tail_test_ordering_")
    atexit.register(shutil.rmtree, dump_dir, ignore_errors=True)
    compiled = k3_tail.compile_tail(CONFIG, mesh, num_tokens, tier=Tier.ONE_KERNEL, weight_layout="column",
                                    dump_to=dump_dir, xla_options=USERS_OPTIMIZATION)
    return compiled, dump_dir


def kernel_machine_code(mesh, num_tokens):
    """(the kernel's KernelCode, its report entry) in one_kernel's compiled call; skips (fails under CI) without
    a disassembler."""
    compiled, dump_dir = users_compile(mesh, num_tokens)
    code = disassembled(machine_code.kernel_code, compiled, KERNEL)
    (gemm,) = k3_tail.xla.report.report(compiled, dump_dir=dump_dir).gemms
    return code, gemm


def amd_ordering_problems(instructions, wavefronts):
    """What leaves a program's partial stores unreleased, or its partial loads unacquired, for one of its
    ``wavefronts`` (empty: none)."""
    problems = []
    if wavefronts != 1:
        problems.append(f"{wavefronts} wavefronts a program: the counter's release and acquire run in one lane of "
                        f"wavefront 0 and order that wavefront alone; the stores and loads of the other "
                        f"{wavefronts - 1} have none of their own")
    atomics = [i for i, text in enumerate(instructions) if text.startswith("global_atomic")]
    if len(atomics) != 1:
        return [*problems, f"expected one atomic (the tile's counter), found {len(atomics)}"]
    atomic = atomics[0]
    stores = [i for i in range(atomic) if instructions[i].startswith(("global_store", "buffer_store", "flat_store"))]
    loads = [i for i in range(atomic + 1, len(instructions))
             if instructions[i].startswith(("global_load", "buffer_load", "flat_load"))]
    if not stores or not loads:
        return [*problems, "expected partial stores before the counter and partial loads after it"]
    release = instructions[stores[-1] + 1:atomic]
    if not _in_order(release, "buffer_wbl2 sc1", "s_waitcnt vmcnt(0)"):
        problems.append(f"no release (buffer_wbl2 sc1, then s_waitcnt vmcnt(0)) between the last store and the "
                        f"atomic: {release}")
    acquire = instructions[atomic + 1:loads[0]]
    if not _in_order(acquire, "s_waitcnt vmcnt(0)", "buffer_inv sc1"):
        problems.append(f"no acquire (s_waitcnt vmcnt(0), then buffer_inv sc1) between the atomic and the first "
                        f"load: {acquire}")
    return problems


def nvidia_ordering_problems(instructions):
    """What leaves the CTA's partial stores unreleased, or its loads unacquired, in SASS (empty: none)."""
    plain = [re.sub(r"^@!?U?P\w+\s+", "", text) for text in instructions]
    atomics = [i for i, text in enumerate(plain) if text.startswith(("ATOMG", "RED"))]
    if len(atomics) != 1:
        return [f"expected one atomic (the tile's counter), found {len(atomics)}"]
    atomic = atomics[0]
    problems = []
    if ".STRONG.GPU" not in plain[atomic]:
        problems.append(f"the counter's atomic is not strong at GPU scope: {plain[atomic]}")
    stores = [i for i in range(atomic) if plain[i].startswith("STG")]
    loads = [i for i in range(atomic + 1, len(plain)) if plain[i].startswith("LDG")]
    if not stores or not loads:
        return [*problems, "expected partial stores before the counter and partial loads after it"]
    if not _in_order(plain[stores[-1] + 1:atomic], "BAR.SYNC", "MEMBAR.ALL.GPU"):
        problems.append("no bar.sync then GPU-scope release (MEMBAR.ALL.GPU) between the last store and the atomic")
    if not _in_order(plain[atomic + 1:loads[0]], "CCTL.IVALL", "BAR.SYNC"):
        problems.append("no L1 invalidation (CCTL.IVALL) then bar.sync between the atomic and the first load")
    return problems


def _in_order(instructions, *wanted):
    """Whether ``wanted`` occur in ``instructions`` in this order (each as a prefix of an instruction)."""
    rest = iter(instructions)
    return all(any(text.startswith(prefix) for text in rest) for prefix in wanted)


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_every_program_releases_its_partials_before_counting_them_and_acquires_before_loading_them(
        target_mesh, num_tokens):
    code, gemm = kernel_machine_code(target_mesh, num_tokens)
    assert gemm.grid[2] > 1, "the grid splits K: the ordering is exercised"
    if device_platform(target_mesh.devices.flat[0]) == "rocm":
        assert code.processor in ("gfx942", "gfx950")
        assert amd_ordering_problems(code.instructions, gemm.warps) == []
    else:
        assert code.processor.startswith("sm_9")
        assert nvidia_ordering_problems(code.instructions) == []


@pytest.mark.parametrize("num_tokens", [1])
def test_the_ptx_orders_the_cta_around_a_gpu_scope_acquire_release_atomic(target_mesh, num_tokens):
    """XLA's dump of the CUDA program holds the kernel's PTX: bar.sync, atom.acq_rel.gpu, bar.sync."""
    if device_platform(target_mesh.devices.flat[0]) != "cuda":
        pytest.skip("PTX is NVIDIA's")
    _, dump_dir = users_compile(target_mesh, num_tokens)
    found = [path.read_text() for path in Path(dump_dir).glob("*.ptx") if KERNEL in path.read_text()]
    if not found:
        pytest.skip("this XLA writes no PTX into its dump (jax 0.12's): the SASS test reads the cubin instead")
    (ptx,) = found
    lines = [line.strip() for line in ptx.splitlines()]
    (atomic,) = [i for i, line in enumerate(lines) if re.search(r"\batom\.\S*\.add", line)]
    assert ".acq_rel" in lines[atomic] and ".gpu" in lines[atomic], lines[atomic]
    assert any(line.startswith("bar.sync") for line in lines[atomic - 12:atomic])
    assert any(line.startswith("bar.sync") for line in lines[atomic + 1:atomic + 20])


def test_a_four_wavefront_program_is_refused_as_the_amd_memory_model_reads_it():
    """The check fails today's 4-wavefront form (one lane's release in wavefront 0), from its own instructions."""
    instructions = ["global_store_dwordx4 v[8:9], v[0:3], off", "s_barrier", "buffer_wbl2 sc1", "s_waitcnt vmcnt(0)",
                    "global_atomic_add v1, v1, v2, s[6:7] sc0", "s_waitcnt vmcnt(0)", "buffer_inv sc1", "s_barrier",
                    "global_load_dword v0, v0, s[4:5]"]
    assert amd_ordering_problems(instructions, 4)[0].startswith("4 wavefronts a program")
    assert amd_ordering_problems(instructions, 1) == []
    assert "no release" in amd_ordering_problems([text for text in instructions if "wbl2" not in text], 1)[0]
