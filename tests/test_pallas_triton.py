"""jax 0.12's DeprecationWarning of the Pallas Triton backend, which it gives at every lowering of a Triton kernel,
never reaches a program whose warnings are errors because selection picked one_kernel (k3_tail.ops.pallas_triton);
every other warning still does. jax 0.10 gives no such warning: the tests run, and pass, there too.

The lowerings are one token on a deviceless GPU topology (tests/triton_lowering.py), where selection picks
one_kernel, each inside ``warnings.catch_warnings()`` with ``warnings.simplefilter("error")`` (what pytest's
``-W error`` does for each test), and in a ``python -W error`` process.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helpers import gpu_mesh_for, topology_params
from k3_tail.ops.pallas_triton import DEPRECATION_MESSAGE, ignore_triton_deprecation_warning
from triton_lowering import KERNEL_NAME, compiled_decode_call, lowered_per_rank_call

JAX_MESSAGE = DEPRECATION_MESSAGE + " and will be removed in a future JAX version."


@pytest.fixture(params=topology_params("h100x8", "mi300xx8", "mi355xx8"))
def topology(request):
    return request.param


def test_the_filter_ignores_jaxs_deprecation_of_the_triton_backend():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ignore_triton_deprecation_warning()
        warnings.warn(JAX_MESSAGE, DeprecationWarning, stacklevel=1)


def test_the_filter_leaves_other_deprecation_warnings_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ignore_triton_deprecation_warning()
        with pytest.raises(DeprecationWarning, match="my own API"):
            warnings.warn("my own API is deprecated", DeprecationWarning, stacklevel=1)


def test_the_filter_leaves_the_same_message_in_another_category_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ignore_triton_deprecation_warning()
        with pytest.raises(UserWarning):
            warnings.warn(JAX_MESSAGE, UserWarning, stacklevel=1)


def test_installing_the_filter_again_adds_no_second_entry():
    with warnings.catch_warnings():
        ignore_triton_deprecation_warning()
        before = list(warnings.filters)
        ignore_triton_deprecation_warning()
        assert warnings.filters == before


def test_the_filter_goes_with_the_warnings_context_it_was_installed_in():
    """As pytest's per-test context drops it after the test: a filter of k3_tail's changes no context around."""
    before = list(warnings.filters)
    with warnings.catch_warnings():
        ignore_triton_deprecation_warning()
    assert warnings.filters == before


def test_the_default_decode_call_compiles_where_warnings_are_errors_again_and_again(topology):
    """The first program traces and lowers the kernel; the second finds the tail's trace cached (no kernel is
    traced again) and lowers the kernel anew, in a warnings context of its own: a second test of a user's suite."""
    mesh = gpu_mesh_for(topology)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert KERNEL_NAME in compiled_decode_call(mesh).as_text()


def test_a_users_shard_map_of_the_per_rank_call_lowers_where_warnings_are_errors(topology):
    mesh = gpu_mesh_for(topology)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert KERNEL_NAME in lowered_per_rank_call(mesh).as_text()


def test_a_users_own_deprecation_warning_still_errors_after_a_one_kernel_lowering(topology):
    mesh = gpu_mesh_for(topology)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled_decode_call(mesh)
        with pytest.raises(DeprecationWarning, match="my own API"):
            warnings.warn("my own API is deprecated", DeprecationWarning, stacklevel=1)


def test_a_python_process_whose_warnings_are_errors_lowers_one_kernel(topology):
    gpu_mesh_for(topology)  # skipped where the topology cannot compile
    script = Path(__file__).with_name("triton_lowering.py")
    result = subprocess.run([sys.executable, "-W", "error", str(script), topology], capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("lowered"), result.stderr[-3000:]
