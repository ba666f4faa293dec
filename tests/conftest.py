"""Test setup: the platform and 8 CPU devices (before jax initialises its backend), and the pytest hooks.

Without ``JAX_PLATFORMS`` the tests run on the CPU backend with 8 forced devices: the ``[aot]``
extra installs a CUDA plugin that would otherwise try to start (and print a traceback) on a machine
without a GPU. ``JAX_PLATFORMS=rocm`` (scripts/rocm_check.sh) or ``=cuda`` runs them on that GPU mesh.

Markers: ``rocm`` tests are skipped unless the default backend is a ROCm GPU; ``slow`` tests (the
full Cartesian products of tests/test_exhaustive.py) are skipped unless the ``-m`` expression names
them: ``pytest -m slow`` (scripts/rocm_check.sh's ``-m "rocm or not rocm"`` still skips them).
The helpers the test modules share live in ``helpers.py``.
"""

import os

import jax
import pytest

if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
# Forced host devices only affect the CPU backend; on a GPU/ROCm host the tests use its devices.
jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    """Skip the ``rocm`` tests unless the default backend is a ROCm GPU, and the ``slow`` ones unless -m names them."""
    skips = {}
    if "slow" not in (config.option.markexpr or ""):
        skips["slow"] = pytest.mark.skip(reason="slow: run with pytest -m slow")
    if not _on_rocm():
        skips["rocm"] = pytest.mark.skip(reason="needs a ROCm GPU mesh: run scripts/rocm_check.sh on a ROCm host")
    for item in items:
        for marker, skip in skips.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


def _on_rocm():
    if os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] not in ("rocm", "gpu"):
        return False
    return "rocm" in jax.devices()[0].client.platform_version.lower()
