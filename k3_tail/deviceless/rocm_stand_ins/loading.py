"""The stand-ins preloaded into this process, and the plugin registered with jax without a GPU."""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import threading
import warnings

from k3_tail.deviceless.rocm_stand_ins.plugin import EXTENSION_PACKAGE, PLUGIN_MODULE, RocmUnavailable
from k3_tail.deviceless.rocm_stand_ins.trust import SONAME, StandIns, check_trusted, check_trusted_path

LOCK = threading.RLock()
LOADED: dict[str, ctypes.CDLL] = {}  # soname -> the preloaded stand-in (kept: never unloaded)


def preload(built: StandIns) -> None:
    """Load the stand-ins by absolute path, ``RTLD_GLOBAL``, the hub first, so that the plugin's NEEDED
    sonames resolve to them; once per process (a soname already loaded is left alone). Each library and the
    path to it are checked as the cache is (:mod:`~k3_tail.deviceless.rocm_stand_ins.trust`); RocmUnavailable names
    what is not to trust."""
    with LOCK:
        pending = [soname for soname in built.libraries if soname not in LOADED]
        # Checked now, just before their constructors run: nobody but you or root can change them after that.
        if pending and not check_trusted_path(built.directory, built.top):
            raise RocmUnavailable(f"the stand-in directory {built.directory} is missing")
        for soname in pending:
            path = built.directory / soname
            if SONAME.fullmatch(soname) is None:
                raise RocmUnavailable(f"the stand-in {soname!r} is not a plain soname in {built.directory}")
            if not check_trusted(path, directory=False, own=True):
                raise RocmUnavailable(f"the stand-in {path} is missing: remove {built.directory} (the stand-ins "
                                      "are rebuilt)")
            try:
                LOADED[soname] = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
            except OSError as error:
                raise RocmUnavailable(
                    f"cannot load the stand-in {soname} from {built.directory}: {error}") from error


def real_rocm_host() -> bool:
    """Whether this machine has an AMD GPU for ROCm: the KFD device node and a GPU among its topology nodes."""
    from jax._src import hardware_utils

    return os.path.exists("/dev/kfd") and hardware_utils.num_available_amd_gpus(stop_at=1) > 0


def plugin_registered() -> bool:
    """Whether jax has the ROCm plugin registered (as a backend factory that can make topologies)."""
    from jax._src import xla_bridge

    return "rocm" in getattr(xla_bridge, "_topology_factories", {})


class _held_back:
    """Within the block, the plugin module's ``initialize`` does nothing (jax's plugin discovery calls it)."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.initialize = self.module.initialize
        self.module.initialize = lambda: None

    def __exit__(self, *exc):
        self.module.initialize = self.initialize


class _one_gpu:
    """Within the block, jax's GPU-presence check reports one AMD GPU."""

    def __enter__(self):
        from jax._src import hardware_utils

        self.hardware_utils = hardware_utils
        self.check = hardware_utils.num_available_amd_gpus
        hardware_utils.num_available_amd_gpus = lambda stop_at=None: 1

    def __exit__(self, *exc):
        self.hardware_utils.num_available_amd_gpus = self.check


def register_plugin() -> None:
    """Register the ROCm plugin without a GPU, once the stand-ins are loaded (the package's docstring, step 3)."""
    import jax

    with LOCK:
        if plugin_registered():
            return
        module = sys.modules.get(PLUGIN_MODULE)
        with warnings.catch_warnings():
            # jax 0.10's ROCm and CUDA plugin extensions both bind one C++ type; nanobind keeps the first binding
            # and warns about the second, whichever plugin loads later (on a ROCm host too).
            warnings.filterwarnings("ignore", r"nanobind: type '\w+' was already registered", RuntimeWarning)
            if module is not None and getattr(module, "rocm_plugin_extension", None) is None:
                module = importlib.reload(module)  # imported before the stand-ins: its extension had failed to load
            elif module is None:
                module = importlib.import_module(PLUGIN_MODULE)
        if getattr(module, "rocm_plugin_extension", None) is None:
            raise RocmUnavailable(f"{EXTENSION_PACKAGE}.rocm_plugin_extension does not load with the stand-ins")
        with _held_back(module):
            try:
                jax.devices()  # plugin discovery and the backends of JAX_PLATFORMS, without the ROCm plugin
            except RuntimeError as error:
                raise RocmUnavailable(f"jax's backends do not start ({error}): set JAX_PLATFORMS=cpu") from error
        with _one_gpu():
            try:
                module.initialize()
            except Exception as error:  # whatever the plugin raises, say it
                raise RocmUnavailable(f"the ROCm plugin does not register with the stand-ins: {error}") from error
        if not plugin_registered():
            raise RocmUnavailable("the ROCm plugin's initialize() did not register it")
