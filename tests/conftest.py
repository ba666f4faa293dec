"""Test setup: the platform and 8 CPU devices (before jax initialises its backend), and the pytest hooks.

Without ``JAX_PLATFORMS`` the tests run on the CPU backend with 8 forced devices: the ``[aot]``
extra installs a CUDA plugin that would otherwise try to start (and print a traceback) on a machine
without a GPU. ``JAX_PLATFORMS=rocm`` (scripts/rocm_check.sh) or ``=cuda`` runs them on that GPU mesh.

Markers: ``rocm`` tests are skipped unless the default backend is a ROCm GPU; ``slow`` tests (the
full Cartesian products of tests/test_exhaustive.py) are left out (deselected) unless the ``-m``
expression names them: ``pytest -m slow`` (scripts/rocm_check.sh's ``-m "rocm or not rocm"`` leaves them out).
The helpers the test modules share live in ``helpers.py``.
"""

import os

import jax
import pytest

from helpers import FAST_COMPILE_XLA_FLAGS

if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
    # The programs the tests check compile fast (helpers.FAST_COMPILE_OPTIONS: no HLO changes), before
    # XLA reads its flags at the backend's start; a GPU run (JAX_PLATFORMS set) compiles as users do.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAGS}".strip()
# Forced host devices only affect the CPU backend; on a GPU/ROCm host the tests use its devices.
jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    """Leave out the ``slow`` tests unless -m names them; skip the ``rocm`` ones unless on a ROCm GPU."""
    if "slow" not in (config.option.markexpr or ""):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    if not _on_rocm():
        skip = pytest.mark.skip(reason="needs a ROCm GPU mesh: run scripts/rocm_check.sh on a ROCm host")
        for item in items:
            if item.get_closest_marker("rocm") is not None:
                item.add_marker(skip)


def _on_rocm():
    if os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] not in ("rocm", "gpu"):
        return False
    return "rocm" in jax.devices()[0].client.platform_version.lower()
