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
   the fix (see the comment on trust below).
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
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

# Bump when what the generator writes changes: the cache key includes it.
GENERATOR_VERSION = 1
PLUGIN_MODULE = "jax_plugins.xla_rocm7"
EXTENSION_PACKAGE = "jax_rocm7_plugin"
PLUGIN_DISTRIBUTIONS = ("jax-rocm7-pjrt", "jax-rocm7-plugin")
MANIFEST = "stand-ins.json"
TRACE_VARIABLE = "K3_TAIL_ROCM_STAND_IN_TRACE"
INSTALL_HINT = ("install k3_tail's [rocm-aot] extra (jax[rocm7-local]: jax-rocm7-pjrt and jax-rocm7-plugin of the "
                "installed jax)")

_lock = threading.RLock()
_loaded: dict[str, ctypes.CDLL] = {}  # soname -> the preloaded stand-in (kept: never unloaded)


class RocmUnavailable(RuntimeError):
    """The ROCm plugin cannot be made to compile here; the message names what is missing and how to get it."""


# --- the plugin's ELF files ------------------------------------------------------------------------------------


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


@dataclasses.dataclass(frozen=True)
class ElfNeeds:
    """What one ELF file asks of the libraries it links, as ``readelf`` shows it."""

    path: Path
    needed: tuple[str, ...]  # NEEDED sonames, in order
    versions: dict[int, tuple[str, str]]  # version index -> (soname, version name), from .gnu.version_r
    undefined: tuple[tuple[str, str, int | None], ...]  # (name, type, version index or None), GLOBAL only


_SYMBOL_KINDS = ("FUNC", "NOTYPE", "OBJECT")


def read_elf(path: Path, readelf: str) -> ElfNeeds:
    """Parse ``readelf -d``, ``-V`` and ``--dyn-syms`` of ``path``."""

    def run(*flags):
        return subprocess.run([readelf, "-W", *flags, str(path)], capture_output=True, text=True, check=True).stdout

    needed = tuple(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run("-d")))
    versions: dict[int, tuple[str, str]] = {}
    requirements = run("-V")
    soname = None
    for line in requirements[requirements.find("Version needs section"):].splitlines():
        if match := re.search(r"\bFile: (\S+)", line):
            soname = match.group(1)
        elif (match := re.search(r"\bName: (\S+)\s+Flags: \S+\s+Version: (\d+)", line)) and soname:
            versions[int(match.group(2))] = (soname, match.group(1))
    undefined = []
    for line in run("--dyn-syms").splitlines():
        fields = line.split()
        # Num: Value Size Type Bind Vis Ndx Name [(version index)]
        if len(fields) < 8 or fields[6] != "UND" or fields[4] != "GLOBAL" or fields[3] not in _SYMBOL_KINDS:
            continue
        name = fields[7].split("@", 1)[0]
        index = None
        if len(fields) > 8 and (match := re.fullmatch(r"\((\d+)\)", fields[8])):
            index = int(match.group(1))
        undefined.append((name, fields[3], index))
    return ElfNeeds(path, needed, versions, tuple(undefined))


# --- what the stand-ins define ---------------------------------------------------------------------------------


@dataclasses.dataclass
class StandInLibrary:
    """One stand-in: its soname, the version nodes it defines and the symbols in each ("" for none)."""

    soname: str
    symbols: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)  # version -> name -> kind

    def add(self, name: str, kind: str, version: str = "") -> None:
        self.symbols.setdefault(version, {})[name] = kind

    @property
    def count(self) -> int:
        return len({name for names in self.symbols.values() for name in names})


def _loadable(soname: str) -> bool:
    """Whether this process's loader finds ``soname`` (a stand-in this process loaded does not count)."""
    if soname in _loaded:
        return False
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


def _defined_by_other_than_stand_ins(handle: ctypes.CDLL, name: str) -> bool:
    """Whether ``name`` resolves through ``handle`` to a library that is not one of this process's stand-ins."""
    try:
        address = ctypes.cast(getattr(handle, name), ctypes.c_void_p).value
    except AttributeError:
        return False
    if not _loaded:
        return True
    info = _DlInfo()
    if not ctypes.CDLL("libdl.so.2").dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return True
    return os.path.basename(os.fsdecode(info.dli_fname)) not in _loaded


# What of the plugin's ELF files reaches the generated files. Symbol names are written as C string literals (each
# function's asm label, the trace message: the C identifiers are the generator's own) that GNU as then reads as
# unquoted symbols, and into the version script, where * ? [ would be glob patterns: letters, digits, _ $ and .
# (C++ mangled names, "name.cold" clones), not first a digit, $ or . (an immediate or a directive to the
# assembler). A versioned symbol's "@VERSION" is not part of its name (read_elf drops it); version names are
# version-script nodes (GLIBC_2.2.5, hip_4.2). Sonames name files in the cache, "-Wl,-soname,..." arguments and
# manifest entries: no "/", no ",", no leading "." (so neither "." nor "..").
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_$.]*")
_VERSION = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_SONAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def _checked(pattern: re.Pattern, name: str, what: str, source: Path) -> str:
    """``name``, where ``pattern`` matches it whole; RocmUnavailable naming it otherwise (it is never written)."""
    if pattern.fullmatch(name) is None:
        raise RocmUnavailable(f"{source} needs the {what} {name!r}, which no stand-in defines (a stand-in {what} "
                              f"matches {pattern.pattern}): reinstall jax-rocm7-pjrt and jax-rocm7-plugin")
    return name


def _stem(soname: str) -> str:
    return re.sub(r"[^a-z0-9]", "", re.sub(r"\.so(\..*)?$", "", soname.removeprefix("lib")).lower())


def plan_stand_ins(needs: Sequence[ElfNeeds]) -> tuple[list[StandInLibrary], str]:
    """The stand-in libraries that ``needs`` call for (a library loadable here gets none), and the hub: the one
    the others link, loaded first, which takes the unversioned symbols no other stand-in claims."""
    # A versioned undefined symbol belongs to the library its version index names; an unversioned one that
    # nothing loadable defines goes to the missing library of the referencing file whose name its own begins
    # with (hipblasLtCreate -> libhipblaslt), else to the hub.
    needed = list(dict.fromkeys(soname for need in needs for soname in need.needed))
    missing = [soname for soname in needed if not _loadable(soname)]
    if not missing:
        return [], ""
    hub = max(missing, key=lambda soname: sum(soname in need.needed for need in needs))
    libraries = {soname: StandInLibrary(soname) for soname in missing}
    present = [ctypes.CDLL(None)] + [ctypes.CDLL(soname) for soname in needed if soname not in libraries]

    def defined_elsewhere(name):
        return any(_defined_by_other_than_stand_ins(handle, name) for handle in present)

    for need in needs:
        own_missing = [_checked(_SONAME, soname, "library", need.path) for soname in need.needed if soname in libraries]
        for soname, version in need.versions.values():  # every version node a file needs must exist
            if soname in libraries:
                libraries[soname].symbols.setdefault(_checked(_VERSION, version, "symbol version", need.path), {})
        for name, kind, index in need.undefined:
            if index is not None and index in need.versions:
                soname, version = need.versions[index]
                if soname in libraries:
                    libraries[soname].add(_checked(_SYMBOL, name, "symbol", need.path), kind, version)
                continue
            if not own_missing or defined_elsewhere(name):
                continue
            lowered = name.lower().lstrip("_")
            matching = [soname for soname in own_missing if lowered.startswith(_stem(soname))]
            home = max(matching, key=lambda soname: len(_stem(soname))) if matching else hub
            if not any(name in names for names in libraries[home].symbols.values()):
                libraries[home].add(_checked(_SYMBOL, name, "symbol", need.path), kind)
    order = [libraries[hub]] + [libraries[soname] for soname in sorted(libraries) if soname != hub]
    return order, hub


_C_PRELUDE = """\
/* A k3_tail stand-in for {soname}: compile-only use of JAX's ROCm plugin without ROCm. Every function fails. */
#include <stdio.h>
#include <stdlib.h>

static const char k3_message[] = "k3_tail ROCm stand-in: no ROCm runtime here (compile only)";
static void *k3_handle[64];
static int k3_trace = -1;

static void k3_called(const char *name) {{
  if (k3_trace < 0) k3_trace = getenv("{trace}") != NULL;
  if (k3_trace) fprintf(stderr, "k3_tail ROCm stand-in called: %s ({soname})\\n", name);
}}
"""


def _returns_text(name: str) -> bool:
    lowered = name.lower()
    return "string" in lowered or lowered.endswith("name")


def c_source(library: StandInLibrary) -> str:
    """The C file of one stand-in: each symbol under its exact name, an asm label (of the charset
    :func:`plan_stand_ins` checks)."""
    lines = [_C_PRELUDE.format(soname=library.soname, trace=TRACE_VARIABLE)]
    names = sorted({(name, kind) for names in library.symbols.values() for name, kind in names.items()})
    for number, (name, kind) in enumerate(names):
        label = f'__asm__("{name}")'
        if kind == "OBJECT":
            lines.append(f"char k3_data_{number}[256] {label};")
            continue
        if name.startswith("__hipRegisterFatBinary"):
            value = "(long)k3_handle"
        elif _returns_text(name):
            value = "(long)k3_message"
        else:
            value = "1"
        lines.append(f'long k3_function_{number}(void) {label};\n'
                     f'long k3_function_{number}(void) {{ k3_called("{name}"); return {value}; }}')
    return "\n".join(lines) + "\n"


def version_script(library: StandInLibrary) -> str | None:
    """The linker version script of one stand-in (None when it defines no version): each node with its
    symbols; unversioned ones join the first node, so that unversioned references find a default version."""
    versions = sorted(version for version in library.symbols if version)
    if not versions:
        return None
    nodes = []
    for position, version in enumerate(versions):
        names = sorted(library.symbols[version])
        if position == 0:
            names = sorted(set(names) | set(library.symbols.get("", {})))
        body = f" global: {' '.join(f'{name};' for name in names)}" if names else ""
        nodes.append(f"{version} {{{body} }};")
    return "\n".join(nodes) + "\n"


# --- building and caching --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StandIns:
    """A built set of stand-ins: where, which libraries in load order, and whether this call built them."""

    directory: Path
    libraries: tuple[str, ...]
    symbols: int
    built: bool
    top: Path  # the cache's own top directory (``$XDG_CACHE_HOME/k3_tail``, or the root given): all of it yours


def cache_home() -> Path:
    """``$XDG_CACHE_HOME``, or ``~/.cache`` where it is unset, empty or relative (the XDG base directory
    specification has relative values ignored: one would name a different directory in every working
    directory). RocmUnavailable when neither is absolute."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(base):
        return Path(base)
    home = os.path.expanduser("~")
    if not os.path.isabs(home):
        raise RocmUnavailable(f"no cache directory for the stand-in ROCm libraries: XDG_CACHE_HOME is unset or "
                              f"relative and so is the home directory ({home!r}): set XDG_CACHE_HOME to an absolute "
                              "directory")
    return Path(home) / ".cache"


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/k3_tail/rocm-stand-ins`` (``~/.cache/k3_tail/rocm-stand-ins`` by default)."""
    return cache_home() / "k3_tail" / "rocm-stand-ins"


def find_tools() -> tuple[str, str]:
    """(C compiler, readelf): ``$CC`` or gcc or cc, and readelf; RocmUnavailable naming what is missing."""
    compiler = next((shutil.which(name) for name in (os.environ.get("CC"), "gcc", "cc") if name and shutil.which(name)),
                    None)
    readelf = shutil.which("readelf")
    missing = [what for what, tool in (("a C compiler (gcc, or $CC)", compiler), ("readelf (GNU binutils)", readelf))
               if tool is None]
    if missing:
        raise RocmUnavailable(
            f"building the stand-in ROCm libraries needs {' and '.join(missing)}, not found on PATH: install them "
            "(Debian/Ubuntu: apt-get install gcc binutils)")
    return compiler, readelf


# What is loaded must be yours, as OpenSSH has it of its files. The cache's own directories and files (its top,
# ``$XDG_CACHE_HOME/k3_tail``, and everything below it) must be your own real directories and regular files, not
# writable by group or others. The directories above the top, up to your home directory (or / outside it), must be
# yours or root's and not writable by group or others unless sticky (/tmp: others cannot rename what is yours
# there): whoever can rename a directory on the path can put another cache in place of the checked one.
_ELSEWHERE = "set XDG_CACHE_HOME to an absolute directory of your own"


def _check(path: Path, *, directory: bool, own: bool) -> bool:
    """Whether ``path`` exists; RocmUnavailable naming it and the fix when the stand-ins must not trust it.
    ``own``: a part of the cache (yours only) rather than a directory above it (yours or root's, or sticky)."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as error:
        raise RocmUnavailable(f"cannot inspect {path} for the stand-in ROCm libraries: {error}") from error
    where = "in the stand-in cache" if own else "above the stand-in cache"
    # A file's content may be another's once it is not to trust: its whole stand-in directory is rebuilt.
    remove = ("remove it (the stand-ins are rebuilt)" if directory else
              f"remove {path.parent} (the stand-ins are rebuilt)")
    kind = "directory" if directory else "regular file"
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(status.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(status.st_mode) else f"not a {kind}"
        raise RocmUnavailable(f"{path} ({where}) is {what}, where a {kind} belongs: {remove if own else _ELSEWHERE}")
    user = os.geteuid()
    if status.st_uid != user and (own or status.st_uid != 0):
        raise RocmUnavailable(f"{path} ({where}) is owned by uid {status.st_uid}, not by you (uid {user})"
                              f"{'' if own else ' or root'}: {remove if own else _ELSEWHERE}")
    if status.st_mode & 0o022 and (own or not (directory and status.st_mode & stat.S_ISVTX)):
        fix = f"chmod go-w {path}" if directory else remove
        raise RocmUnavailable(f"{path} ({where}) is writable by group or others, who could replace the stand-in ROCm "
                              f"libraries: {fix if own else f'{fix}, or {_ELSEWHERE}'}")
    return True


def _check_path(directory: Path, top: Path) -> bool:
    """Whether ``directory`` (``top`` or within it) exists; each level is checked, from the highest down (so that
    the first one in the way is named), and RocmUnavailable names the first one not to trust."""
    levels = [directory, *directory.parents]
    own = levels[:levels.index(top) + 1]
    home = Path(os.path.realpath(os.path.expanduser("~")))
    above = []
    for level in top.parents:
        above.append(level)
        if level == home:
            break
    for level, is_own in [*((level, False) for level in reversed(above)), *((level, True) for level in reversed(own))]:
        if not _check(level, directory=True, own=is_own):
            return False
    return True


def _make_directories(directory: Path, top: Path) -> None:
    """Make the missing levels of ``directory``, each 0700, and check the whole path."""
    missing = list(itertools.takewhile(lambda level: not os.path.lexists(level), [directory, *directory.parents]))
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:  # another process made it: checked below
            pass
        except OSError as error:
            _check_path(directory, top)  # names a level in the way (a file where a directory belongs)
            raise RocmUnavailable(f"cannot make the stand-in cache directory {level}: {error}") from error
    _check_path(directory, top)


def _locations(root: Path | None) -> tuple[Path, Path]:
    """(where the stand-in directories go, the cache's top), symbolic links up to the top resolved (the checks
    then see the directories that hold the cache, not the links)."""
    if root is None:
        top = Path(os.path.realpath(cache_home() / "k3_tail"))
        return top / "rocm-stand-ins", top
    root = Path(os.path.realpath(root))
    return root, root


def _cached(directory: Path, top: Path) -> tuple[tuple[str, ...], int] | None:
    """(libraries, symbols) of the stand-ins in ``directory`` (None when it does not exist), from its manifest;
    RocmUnavailable naming what is not to trust or malformed, and the fix."""
    if not _check_path(directory, top):
        return None
    path = directory / MANIFEST
    fix = f"remove {directory} (the stand-ins are rebuilt)"
    if not _check(path, directory=False, own=True):
        raise RocmUnavailable(f"{directory} has no {MANIFEST}: it is incomplete or not k3_tail's; {fix}")
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as error:  # ValueError: JSON syntax and UTF-8
        raise RocmUnavailable(f"the stand-in manifest {path} does not read as JSON ({error}): {fix}") from error
    if not isinstance(manifest, dict):
        raise RocmUnavailable(f"the stand-in manifest {path} is not a JSON object: {fix}")
    libraries, symbols = manifest.get("libraries"), manifest.get("symbols")
    if not isinstance(libraries, list) or not all(isinstance(soname, str) for soname in libraries):
        raise RocmUnavailable(f"the stand-in manifest {path}: 'libraries' is {libraries!r}, not a list of sonames: "
                              f"{fix}")
    for soname in libraries:
        if _SONAME.fullmatch(soname) is None:
            raise RocmUnavailable(f"the stand-in manifest {path} lists the library {soname!r}, not a plain soname in "
                                  f"its directory (no path, separator or '..'): {fix}")
    if type(symbols) is not int or symbols < 0:
        raise RocmUnavailable(f"the stand-in manifest {path}: 'symbols' is {symbols!r}, not a count: {fix}")
    return tuple(libraries), symbols


def stand_ins(plugin: Plugin | None = None, *, root: Path | None = None) -> StandIns:
    """The stand-ins for ``plugin`` (the installed one by default): from the cache, or built into it now.

    ``root``: where the stand-in directories go (``cache_root()`` by default; the top of the cache then is its
    parent, ``$XDG_CACHE_HOME/k3_tail``). Every check of the module's comment on trust applies."""
    plugin = plugin or installed_plugin()
    root, top = _locations(root)
    directory = root / f"{plugin.version}-{plugin.digest()}"
    cached = _cached(directory, top)
    built = False
    if cached is None:
        compiler, readelf = find_tools()
        _make_directories(root, top)
        try:
            work = Path(tempfile.mkdtemp(prefix=".building-", dir=root))  # 0700
        except OSError as error:
            raise RocmUnavailable(f"cannot build the stand-in ROCm libraries in {root}: {error}") from error
        try:
            _build(plugin, work, compiler, readelf)
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
        cached = _cached(directory, top)
        if cached is None:
            raise RocmUnavailable(f"the stand-in ROCm libraries in {directory} went missing while built: try again")
    return StandIns(directory, *cached, built, top)


def _build(plugin: Plugin, work: Path, compiler: str, readelf: str) -> None:
    try:
        needs = [read_elf(path, readelf) for path in plugin.elf_files]
    except subprocess.CalledProcessError as error:
        raise RocmUnavailable(f"readelf failed on the ROCm plugin: {error.stderr.strip()}") from error
    libraries, hub = plan_stand_ins(needs)
    for library in libraries:
        stem = re.sub(r"[^A-Za-z0-9]", "_", library.soname)
        (work / f"{stem}.c").write_text(c_source(library))
        command = [compiler, "-shared", "-fPIC", "-O1", "-w", "-fno-builtin", "-o", str(work / library.soname),
                   str(work / f"{stem}.c"), f"-Wl,-soname,{library.soname}"]
        script = version_script(library)
        if script is not None:
            (work / f"{stem}.map").write_text(script)
            command.append(f"-Wl,--version-script={work / f'{stem}.map'}")
        if library.soname != hub:  # as the real ones do; and RTLD_LOCAL users then see the hub's symbols too
            command += [f"-L{work}", "-Wl,--no-as-needed", f"-l:{hub}", "-Wl,-rpath,$ORIGIN"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RocmUnavailable(
                f"building the stand-in {library.soname} failed ({compiler}): {result.stderr.strip()}")
    manifest = {
        "plugin": plugin.version,
        "files": [str(path) for path in plugin.elf_files],
        "libraries": [library.soname for library in libraries],
        "symbols": sum(library.count for library in libraries),
        "per_library": {library.soname: library.count for library in libraries},
        "generator": GENERATOR_VERSION,
    }
    (work / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for path in work.iterdir():  # private whatever the umask: group- or other-writable files are refused
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o077)


# --- loading and registering -----------------------------------------------------------------------------------


def preload(built: StandIns) -> None:
    """Load the stand-ins by absolute path, ``RTLD_GLOBAL``, the hub first, so that the plugin's NEEDED
    sonames resolve to them; once per process (a soname already loaded is left alone). Each library and the
    path to it are checked as :func:`stand_ins` checks the cache; RocmUnavailable names what is not to trust."""
    with _lock:
        pending = [soname for soname in built.libraries if soname not in _loaded]
        # Checked now, just before their constructors run: nobody but you or root can change them after that.
        if pending and not _check_path(built.directory, built.top):
            raise RocmUnavailable(f"the stand-in directory {built.directory} is missing")
        for soname in pending:
            path = built.directory / soname
            if _SONAME.fullmatch(soname) is None:
                raise RocmUnavailable(f"the stand-in {soname!r} is not a plain soname in {built.directory}")
            if not _check(path, directory=False, own=True):
                raise RocmUnavailable(f"the stand-in {path} is missing: remove {built.directory} (the stand-ins "
                                      "are rebuilt)")
            try:
                _loaded[soname] = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
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
    """Register the ROCm plugin without a GPU, once the stand-ins are loaded (see the module docstring)."""
    import jax

    with _lock:
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


def ensure_rocm_plugin() -> StandIns | None:
    """Make ``get_topology_desc(..., "rocm", ...)`` work here: nothing on a ROCm host or when the plugin is
    registered already; elsewhere the stand-ins built (or reused), preloaded and the plugin registered.
    Returns the stand-ins used (None when none were needed); RocmUnavailable says what is missing."""
    with _lock:
        if plugin_registered() or real_rocm_host():
            return None
        plugin = installed_plugin()
        built = stand_ins(plugin)
        preload(built)
        register_plugin()
        return built


