"""Test setup: the platform and 8 CPU devices (before jax initialises its backend), and the meshes.

Without ``JAX_PLATFORMS`` the tests run on the CPU backend with 8 forced devices: the ``[aot]``
extra installs a CUDA plugin that would otherwise try to start (and print a traceback) on a machine
without a GPU. ``JAX_PLATFORMS=rocm`` (scripts/rocm_check.sh) or ``=cuda`` runs them on that GPU mesh.
"""

import json
import os
import time

import jax
import pytest

import k3_tail

if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
# Forced host devices only affect the CPU backend; on a GPU/ROCm host the tests use its devices.
jax.config.update("jax_num_cpu_devices", 8)


def make_tp_mesh(tp_size, axis_type=jax.sharding.AxisType.Explicit):
    """A 1-d mesh named "tp" over the first ``tp_size`` devices (skips when there are fewer)."""
    if len(jax.devices()) < tp_size:
        pytest.skip(f"needs {tp_size} devices, have {len(jax.devices())}")
    return jax.make_mesh((tp_size,), ("tp",), axis_types=(axis_type,), devices=jax.devices()[:tp_size])


def pytest_collection_modifyitems(config, items):
    """Skip the ``rocm`` tests unless the default backend is a ROCm GPU."""
    if _on_rocm():
        return
    skip = pytest.mark.skip(reason="needs a ROCm GPU mesh: run scripts/rocm_check.sh on a ROCm host")
    for item in items:
        if "rocm" in item.keywords:
            item.add_marker(skip)


def _on_rocm():
    if os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] not in ("rocm", "gpu"):
        return False
    return "rocm" in jax.devices()[0].client.platform_version.lower()


def tier_layouts():
    """Every (tier, weight layout) pair that runs: the one_shot tier needs the replicated kernel."""
    return [
        pytest.param(tier, layout, id=f"{tier.value}-{layout}")
        for tier in k3_tail.Tier
        for layout in k3_tail.WEIGHT_LAYOUTS
        if tier.supports(layout)
    ]


def layout_for(tier, preferred="column"):
    """``preferred`` when ``tier`` runs with it, else "replicated"."""
    return preferred if tier.supports(preferred) else "replicated"


def once_per_session(tmp_path_factory, name, produce, *, timeout_s):
    """``produce(directory)``'s JSON-serialisable result, computed once per test session.

    Under pytest-xdist every worker asks for it; the worker that creates the shared directory first
    runs ``produce`` there and the others wait for its result (at most ``timeout_s``). Returns
    (directory, result). A ``produce`` that raises fails every test that asked for the result.
    """
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's directory, above each worker's own
    directory = shared / name
    result_path = directory / "result.json"
    try:
        directory.mkdir()  # atomic: exactly one worker gets here first
    except FileExistsError:
        deadline = time.monotonic() + timeout_s
        while not result_path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not result_path.exists():
            pytest.fail(f"{name}: the worker producing it did not finish within {timeout_s} s", pytrace=False)
    else:
        outcome = {"error": "interrupted"}
        try:
            outcome = {"result": produce(directory)}
        except Exception as error:  # reported below, to this worker's tests and the others' alike
            outcome = {"error": f"{type(error).__name__}: {error}"}
        finally:
            # Written whole, then renamed: a waiting worker never reads half of it.
            partial = directory / "result.partial"
            partial.write_text(json.dumps(outcome))
            partial.rename(result_path)
    outcome = json.loads(result_path.read_text())
    if "error" in outcome:
        pytest.fail(f"{name}: {outcome['error']}", pytrace=False)
    return directory, outcome["result"]
