"""Test setup: the platform and 8 CPU devices (before jax initialises its backend), and the pytest hooks.

Without ``JAX_PLATFORMS`` the tests run on the CPU backend with 8 forced devices: the ``[aot]``
extra installs a CUDA plugin that would otherwise try to start (and print a traceback) on a machine
without a GPU. ``JAX_PLATFORMS=rocm`` (scripts/rocm_check.sh) or ``=cuda`` runs them on that GPU mesh.

Markers: ``rocm`` tests are skipped unless the default backend is a ROCm GPU; ``slow`` tests (the
full Cartesian products of tests/test_exhaustive.py) are left out (deselected) unless the ``-m``
expression names them: ``pytest -m slow`` (scripts/rocm_check.sh's ``-m "(rocm or not rocm) and not compiled"``
and ``-m compiled`` leave them out);
``compiled`` tests compile for a deviceless GPU topology (``helpers.topology_params``) or the host's ROCm mesh, or
test how. Those of a GPU topology are left out too unless ``-m`` names ``compiled`` or ``--topologies`` (or
``K3_TAIL_TEST_TOPOLOGIES``) names topologies: ``pytest -n 2`` checks what runs on this machine, ``pytest -n 2 -m
compiled`` the GPU programs for every topology that compiles here. ``--topologies h100x8,mi300xx8`` names the
topologies they must compile for (helpers.gpu_mesh_for); .ci/run runs ``-m compiled`` for h100x8, mi300xx8 and
mi355xx8 in environments with the ROCm wheels, on jax 0.12 and on jax 0.10.2.
The helpers the test modules share live in ``helpers.py``.
"""

import os
import signal

import jax
import pytest

from helpers import FAST_COMPILE_XLA_FLAGS, GPU_TOPOLOGIES, TOPOLOGIES_VARIABLE, kimi_layer_compiled, named_topologies

if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
    # The programs the tests check compile fast (helpers.FAST_COMPILE_OPTIONS: no HLO changes), before
    # XLA reads its flags at the backend's start; a GPU run (JAX_PLATFORMS set) compiles as users do.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAGS}".strip()
# Forced host devices only affect the CPU backend; on a GPU/ROCm host the tests use its devices.
jax.config.update("jax_num_cpu_devices", 8)


def pytest_addoption(parser):
    parser.addoption("--topologies", default=None,
                     help=f"comma-separated GPU topologies the compiled tests must compile for ({TOPOLOGIES_VARIABLE})")


def pytest_configure(config):
    # Under pytest-xdist (-n 2) idle workers take queued tests from busy ones: the suite's few long tests
    # (the notebook, the multi-process runs) otherwise leave one worker idle at the end.
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "worksteal"
    if config.getoption("--topologies"):
        os.environ[TOPOLOGIES_VARIABLE] = config.getoption("--topologies")  # pytest-xdist workers inherit it


def pytest_collection_modifyitems(config, items):
    """Leave out the ``slow`` tests unless -m names them; the compiled tests of GPU topologies unless -m names
    ``compiled`` or K3_TAIL_TEST_TOPOLOGIES names topologies, and then those of the topologies it does not name;
    skip the ``rocm`` ones unless on a ROCm GPU; run the ``compiled`` tests first (below)."""
    named = named_topologies()
    if not _named_by_markexpr(config, "slow"):
        _deselect(config, items, lambda item: item.get_closest_marker("slow") is not None)
    if _leaves_out_gpu_programs(config):
        _deselect(config, items, lambda item: _topology(item) is not None)
    if named is not None:
        _deselect(config, items, lambda item: _topology(item) not in (None, *named))
    if not _on_rocm():
        skip = pytest.mark.skip(reason="needs a ROCm GPU mesh: run scripts/rocm_check.sh on a ROCm host")
        for item in items:
            if item.get_closest_marker("rocm") is not None:
                item.add_marker(skip)
    # The compiled tests of several modules compile the same programs (helpers.compiled_tail keeps them per
    # process): first in the order, they start together on one pytest-xdist worker (which gets the first half
    # and is stolen from at its end), not half of them on each. A stable sort: the rest keep their order.
    items.sort(key=lambda item: item.get_closest_marker("compiled") is None)


def pytest_report_header(config):
    if _leaves_out_gpu_programs(config):
        return "k3_tail: the GPU-program tests are left out (pytest -m compiled runs them)"
    return None


def _named_by_markexpr(config, marker):
    return marker in (config.option.markexpr or "")


def _leaves_out_gpu_programs(config):
    """Whether this run leaves out the compiled tests of GPU topologies: neither -m nor --topologies asks for them."""
    return named_topologies() is None and not _named_by_markexpr(config, "compiled")


def _deselect(config, items, left_out):
    """Remove the items ``left_out`` picks from ``items``, reporting them deselected."""
    deselected = [item for item in items if left_out(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not left_out(item)]


def _topology(item):
    """The GPU topology a ``compiled`` test compiles for (a param from helpers.topology_params), or None."""
    if item.get_closest_marker("compiled") is None or not hasattr(item, "callspec"):
        return None
    return next((value for value in item.callspec.params.values() if value in (*GPU_TOPOLOGIES, "rocm")), None)


def _on_rocm():
    if os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] not in ("rocm", "gpu"):
        return False
    return "rocm" in jax.devices()[0].client.platform_version.lower()


@pytest.fixture
def fails_if_blocked():
    """Fails a test that blocks (opening a FIFO for reading waits for a writer) instead of hanging it."""
    def interrupt(signum, frame):
        raise TimeoutError("blocked for 10 s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def kimi_layer_figures(tmp_path_factory):
    """(topology, T, quantization) -> ``figures.CompiledFigures`` of the Kimi-K3 layer, compiled once per session
    (``helpers.kimi_layer_compiled``)."""
    from k3_tail.models.kimi_k3.figures import CompiledFigures

    def figures(topology, num_tokens, quantization):
        return CompiledFigures(**kimi_layer_compiled(tmp_path_factory, topology, num_tokens, quantization)["figures"])

    return figures
