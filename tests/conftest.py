"""Test setup: 8 CPU devices (before jax initialises its backend) and the meshes built on them."""

import jax
import pytest

# Forced host devices only affect the CPU backend; on a GPU/ROCm host the tests use its devices.
jax.config.update("jax_num_cpu_devices", 8)


def make_tp_mesh(tp_size, axis_type=jax.sharding.AxisType.Explicit):
    """A 1-d mesh named "tp" over the first ``tp_size`` devices (skips when there are fewer)."""
    if len(jax.devices()) < tp_size:
        pytest.skip(f"needs {tp_size} devices, have {len(jax.devices())}")
    return jax.make_mesh((tp_size,), ("tp",), axis_types=(axis_type,), devices=jax.devices()[:tp_size])
