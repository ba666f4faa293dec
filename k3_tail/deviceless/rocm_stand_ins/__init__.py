"""Deviceless ROCm compiles: stand-in ROCm runtime libraries for JAX's ROCm plugin, and its registration
without a GPU.

JAX's ROCm 7 PJRT plugin (``jax-rocm7-pjrt`` and ``jax-rocm7-plugin``) contains XLA's whole AMDGPU
compiler, but its shared libraries link the ROCm runtime (libamdhip64, hipBLASLt, rocBLAS, MIOpen, RCCL,
...), and its ``initialize()`` refuses to register when the KFD driver lists no GPU. Compiling for a
deviceless topology calls none of those libraries beyond the kernel registrations the plugin runs when it
loads, so on a machine without ROCm:

1. :func:`stand_ins` builds, once per plugin build, a stand-in for every library the plugin and its
   extension modules need and the loader cannot find, from the plugin's own ELF files (``readelf``: NEEDED
   sonames, the symbol versions needed from each, undefined symbols nothing loadable defines). Each is one
   C file and linker version script (``gcc -shared``) whose functions all fail (an error code, a static
   message, a handle for ``__hipRegisterFatBinary``). They are cached under
   ``$XDG_CACHE_HOME/k3_tail/rocm-stand-ins/`` (``~/.cache`` without it or when it is relative), keyed by
   the plugin's version, its files' sizes and times and the generator's version, and renamed into place
   from a temporary directory, so that processes building at once do not race. The cache is trusted as
   OpenSSH trusts its files: each directory made 0700; everything in it yours and not writable by group
   or others; the directories above it, up to your home, yours or root's and not writable by others unless
   sticky; the manifest well-formed and listing plain sonames; the names taken from the ELF files of a
   charset the generated files can hold. Anything else is a RocmUnavailable naming the path or name and
   the fix (:mod:`~k3_tail.deviceless.rocm_stand_ins.trust`).
2. :func:`preload` loads them by absolute path with ``RTLD_GLOBAL``, the hub first, so the loader finds
   each soname already loaded (``LD_LIBRARY_PATH`` set after start does not reach ``dlopen``).
3. :func:`register_plugin` (re)imports the plugin module, lets jax's plugin discovery and backends start
   with its ``initialize`` held back (so it never becomes a backend jax tries to start), then calls
   ``initialize()`` with jax's AMD GPU count reporting one for that call only. No ROCm client is created:
   the plugin serves ``get_topology_desc(..., "rocm", ...)``, all :func:`k3_tail.topology_mesh` needs.

:func:`ensure_rocm_plugin` does all three, only for a ROCm topology and only without an AMD GPU
(:func:`real_rocm_host`); nothing runs at import time. Compile only: no autotuning (GEMM tiles and the
choice between Triton and hipBLASLt are XLA's defaults), and the kernels jax's ROCm extension modules
register when jax is imported (linear algebra, sparse, PRNG, RNN, Pallas's Triton calls) are missing when
jax was imported first, the usual order. ``K3_TAIL_ROCM_STAND_IN_TRACE=1`` logs each stand-in call.

The parts, by what each does: :mod:`~k3_tail.deviceless.rocm_stand_ins.plugin` (the installed plugin),
:mod:`~k3_tail.deviceless.rocm_stand_ins.generator` (the stand-ins planned from its ELF files, written and
compiled), :mod:`~k3_tail.deviceless.rocm_stand_ins.trust` (the cache and its checks) and
:mod:`~k3_tail.deviceless.rocm_stand_ins.loading` (preloading and registration); this module puts them together.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from k3_tail.deviceless.rocm_stand_ins.generator import (
    ElfNeeds,
    build,
    c_source,
    find_tools,
    plan_stand_ins,
    read_elf,
    version_script,
)
from k3_tail.deviceless.rocm_stand_ins.loading import LOCK, plugin_registered, preload, real_rocm_host, register_plugin
from k3_tail.deviceless.rocm_stand_ins.plugin import (
    INSTALL_HINT,
    PLUGIN_MODULE,
    Plugin,
    RocmUnavailable,
    installed_plugin,
)
from k3_tail.deviceless.rocm_stand_ins.trust import (
    MANIFEST,
    StandIns,
    cache_root,
    cached_stand_ins,
    locations,
    make_directories,
)

# What the rest of k3_tail and its tests take from here, besides this module's own two functions.
__all__ = ["INSTALL_HINT", "MANIFEST", "PLUGIN_MODULE", "ElfNeeds", "Plugin", "RocmUnavailable", "StandIns", "c_source",
           "cache_root", "ensure_rocm_plugin", "find_tools", "installed_plugin", "plan_stand_ins", "plugin_registered",
           "preload", "read_elf", "real_rocm_host", "stand_ins", "version_script"]


def stand_ins(plugin: Plugin | None = None, *, root: Path | None = None) -> StandIns:
    """The stand-ins for ``plugin`` (the installed one by default): from the cache, or built into it now.

    ``root``: where the stand-in directories go (``cache_root()`` by default; the top of the cache then is its
    parent, ``$XDG_CACHE_HOME/k3_tail``). Every check of :mod:`~k3_tail.deviceless.rocm_stand_ins.trust` applies."""
    plugin = plugin or installed_plugin()
    root, top = locations(root)
    directory = root / f"{plugin.version}-{plugin.digest()}"
    cached = cached_stand_ins(directory, top)
    built = False
    if cached is None:
        compiler, readelf = find_tools()
        make_directories(root, top)
        try:
            work = Path(tempfile.mkdtemp(prefix=".building-", dir=root))  # 0700
        except OSError as error:
            raise RocmUnavailable(f"cannot build the stand-in ROCm libraries in {root}: {error}") from error
        try:
            build(plugin, work, compiler, readelf)
            try:
                os.rename(work, directory)  # atomic: a complete directory or none
                built = True
            except OSError as error:
                if not os.path.lexists(directory):  # not another process's finished build: a real failure
                    raise RocmUnavailable(
                        f"cannot put the stand-in ROCm libraries into {directory}: {error}") from error
        except OSError as error:
            raise RocmUnavailable(f"cannot build the stand-in ROCm libraries in {work}: {error}") from error
        finally:
            shutil.rmtree(work, ignore_errors=True)
        cached = cached_stand_ins(directory, top)
        if cached is None:
            raise RocmUnavailable(f"the stand-in ROCm libraries in {directory} went missing while built: try again")
    return StandIns(directory, *cached, built, top)


def ensure_rocm_plugin() -> StandIns | None:
    """Make ``get_topology_desc(..., "rocm", ...)`` work here: nothing on a ROCm host or when the plugin is
    registered already; elsewhere the stand-ins built (or reused), preloaded and the plugin registered.
    Returns the stand-ins used (None when none were needed); RocmUnavailable says what is missing."""
    with LOCK:
        if plugin_registered() or real_rocm_host():
            return None
        plugin = installed_plugin()
        built = stand_ins(plugin)
        preload(built)
        register_plugin()
        return built
