"""What the tests of the deviceless ROCm stand-ins (k3_tail.deviceless.rocm_stand_ins) share: their skip marks, a
fresh Python process, and a fake plugin whose runtime libraries are missing."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from helpers import ROCM_WHEELS
from k3_tail.deviceless import rocm_stand_ins


def needs_rocm_wheels(test):
    """A test of the deviceless ROCm mechanism: it runs where the ROCm wheels are (``-m compiled`` there) and no
    AMD GPU is (a ROCm host keeps its own libraries: scripts/rocm_check.sh)."""
    skip = pytest.mark.skipif(not ROCM_WHEELS, reason="needs the [rocm-aot] extra (.ci/run's .venv-rocm)")
    real_host = pytest.mark.skipif(ROCM_WHEELS and rocm_stand_ins.real_rocm_host(),
                                   reason="a ROCm host uses its own ROCm libraries, no stand-ins")
    return pytest.mark.compiled(real_host(skip(test)))


needs_tools = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("readelf") is None,
                                 reason="needs gcc and readelf")


def run_python(script, **environment):
    """Run ``script`` in a fresh interpreter (JAX_PLATFORMS=cpu unless given; a variable given None is unset) and
    return the completed process."""
    environment = {"JAX_PLATFORMS": "cpu", **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **environment}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env={k: v for k, v in environment.items() if v is not None}, timeout=300, check=False)


# A fresh process that asks for 8 x MI300X and prints the TopologyUnavailable it gets.
PRINT_TOPOLOGY_ERROR = """
    import k3_tail
    try:
        k3_tail.topology_mesh("mi300xx8")
    except k3_tail.TopologyUnavailable as error:
        print(error)
    """


FAKE_RUNTIME = {
    # soname: (C source, version script or None)
    "libk3fake.so.1": ("int k3fake_add(int a, int b) { return a + b; }\nint k3fake_new(void) { return 0; }\n",
                       "K3FAKE_1.0 { global: k3fake_add; local: *; };\n"
                       "K3FAKE_2.0 { global: k3fake_new; } K3FAKE_1.0;\n"),
    "libk3plain.so.2": ("int k3plain_hello(void) { return 7; }\n", None),
}
FAKE_PLUGIN = """
extern int k3fake_add(int, int);
extern int k3fake_new(void);
extern int k3plain_hello(void);
int fake_plugin_call(void) { return k3fake_add(2, 3) + 10 * k3fake_new() + 100 * k3plain_hello(); }
"""


def build_fake_plugin(directory):
    """A "plugin" ELF that links two libraries (one with symbol versions) that are then removed, as a machine
    without ROCm lacks the plugin's runtime (needs gcc: :data:`needs_tools`)."""
    runtime = directory / "runtime"
    runtime.mkdir()
    for soname, (source, script) in FAKE_RUNTIME.items():
        (runtime / f"{soname}.c").write_text(source)
        command = ["gcc", "-shared", "-fPIC", "-o", str(runtime / soname), str(runtime / f"{soname}.c"),
                   f"-Wl,-soname,{soname}"]
        if script:
            (runtime / f"{soname}.map").write_text(script)
            command.append(f"-Wl,--version-script={runtime / f'{soname}.map'}")
        subprocess.run(command, check=True)
    (directory / "plugin.c").write_text(FAKE_PLUGIN)
    plugin = directory / "fake_plugin.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(plugin), str(directory / "plugin.c"), f"-L{runtime}",
                    "-l:libk3fake.so.1", "-l:libk3plain.so.2"], check=True)
    shutil.rmtree(runtime)
    return rocm_stand_ins.Plugin("0.0.test", plugin, ())
