"""The stand-in libraries: what the plugin's ELF files need (``readelf``), which stand-in defines each missing
symbol, and their C files and linker version scripts, compiled (``gcc -shared``) into a build directory."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

from k3_tail.deviceless.rocm_stand_ins.loading import LOADED
from k3_tail.deviceless.rocm_stand_ins.plugin import GENERATOR_VERSION, Plugin, RocmUnavailable
from k3_tail.deviceless.rocm_stand_ins.trust import MANIFEST, SONAME, SYMBOL, VERSION

TRACE_VARIABLE = "K3_TAIL_ROCM_STAND_IN_TRACE"


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
    if soname in LOADED:
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
    if not LOADED:
        return True
    info = _DlInfo()
    if not ctypes.CDLL("libdl.so.2").dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return True
    return os.path.basename(os.fsdecode(info.dli_fname)) not in LOADED


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
        own_missing = [_checked(SONAME, soname, "library", need.path) for soname in need.needed if soname in libraries]
        for soname, version in need.versions.values():  # every version node a file needs must exist
            if soname in libraries:
                libraries[soname].symbols.setdefault(_checked(VERSION, version, "symbol version", need.path), {})
        for name, kind, index in need.undefined:
            if index is not None and index in need.versions:
                soname, version = need.versions[index]
                if soname in libraries:
                    libraries[soname].add(_checked(SYMBOL, name, "symbol", need.path), kind, version)
                continue
            if not own_missing or defined_elsewhere(name):
                continue
            lowered = name.lower().lstrip("_")
            matching = [soname for soname in own_missing if lowered.startswith(_stem(soname))]
            home = max(matching, key=lambda soname: len(_stem(soname))) if matching else hub
            if not any(name in names for names in libraries[home].symbols.values()):
                libraries[home].add(_checked(SYMBOL, name, "symbol", need.path), kind)
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


def build(plugin: Plugin, work: Path, compiler: str, readelf: str) -> None:
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
