"""The installed ROCm plugin: its version and ELF files (what the stand-ins are built for and keyed by), and the
error every part of the stand-ins raises."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

# Bump when what the generator writes changes: the cache key includes it.
GENERATOR_VERSION = 1
PLUGIN_MODULE = "jax_plugins.xla_rocm7"
EXTENSION_PACKAGE = "jax_rocm7_plugin"
PLUGIN_DISTRIBUTIONS = ("jax-rocm7-pjrt", "jax-rocm7-plugin")
INSTALL_HINT = ("install k3_tail's [rocm-aot] extra (jax[rocm7-local]: jax-rocm7-pjrt and jax-rocm7-plugin of the "
                "installed jax)")


class RocmUnavailable(RuntimeError):
    """The ROCm plugin cannot be made to compile here; the message names what is missing and how to get it."""


@dataclasses.dataclass(frozen=True)
class Plugin:
    """The installed ROCm plugin: its version and the ELF files whose needs the stand-ins meet."""

    version: str
    library: Path  # xla_rocm_plugin.so
    extensions: tuple[Path, ...]  # jax_rocm7_plugin/*.so

    @property
    def elf_files(self) -> tuple[Path, ...]:
        return (self.library, *self.extensions)

    def digest(self) -> str:
        """What the cache is keyed by: the plugin's files (name, size, modification time) and the generator."""
        key = hashlib.sha256(f"generator {GENERATOR_VERSION}\nplugin {self.version}\n".encode())
        for path in self.elf_files:
            status = path.stat()
            key.update(f"{path.name} {status.st_size} {status.st_mtime_ns}\n".encode())
        return key.hexdigest()[:16]


def installed_plugin() -> Plugin:
    """The ROCm plugin installed beside jax; RocmUnavailable naming what is missing or mismatched."""
    versions = {}
    for distribution in PLUGIN_DISTRIBUTIONS:
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[distribution] = None
    missing = [name for name, version in versions.items() if version is None]
    if missing:
        raise RocmUnavailable(f"{' and '.join(missing)} not installed: {INSTALL_HINT}")
    jaxlib_version = importlib.metadata.version("jaxlib")
    if set(versions.values()) != {jaxlib_version}:
        found = ", ".join(f"{name} {version}" for name, version in versions.items())
        raise RocmUnavailable(
            f"the ROCm plugin ({found}) is not the version of jaxlib {jaxlib_version}: {INSTALL_HINT}")
    library_spec = importlib.util.find_spec(PLUGIN_MODULE)
    extension_spec = importlib.util.find_spec(EXTENSION_PACKAGE)
    if library_spec is None or extension_spec is None or not library_spec.submodule_search_locations:
        raise RocmUnavailable(f"{PLUGIN_MODULE} or {EXTENSION_PACKAGE} cannot be imported: {INSTALL_HINT}")
    library = Path(next(iter(library_spec.submodule_search_locations))) / "xla_rocm_plugin.so"
    if not library.exists():
        raise RocmUnavailable(f"{library} is missing: reinstall jax-rocm7-pjrt ({INSTALL_HINT})")
    extensions = tuple(sorted(Path(next(iter(extension_spec.submodule_search_locations))).glob("*.so")))
    return Plugin(versions["jax-rocm7-plugin"], library, extensions)
