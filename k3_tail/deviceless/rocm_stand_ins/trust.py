"""The stand-in cache and what it trusts: where it is, who may own and write each level of it, its manifest, and the
names that may reach the files the generator writes."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import stat
from pathlib import Path

from k3_tail.deviceless.rocm_stand_ins.plugin import RocmUnavailable

MANIFEST = "stand-ins.json"

# What of the plugin's ELF files reaches the generated files. Symbol names are written as C string literals (each
# function's asm label, the trace message: the C identifiers are the generator's own) that GNU as then reads as
# unquoted symbols, and into the version script, where * ? [ would be glob patterns: letters, digits, _ $ and .
# (C++ mangled names, "name.cold" clones), not first a digit, $ or . (an immediate or a directive to the
# assembler). A versioned symbol's "@VERSION" is not part of its name (read_elf drops it); version names are
# version-script nodes (GLIBC_2.2.5, hip_4.2). Sonames name files in the cache, "-Wl,-soname,..." arguments and
# manifest entries: no "/", no ",", no leading "." (so neither "." nor "..").
SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_$.]*")
VERSION = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
SONAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


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


@dataclasses.dataclass(frozen=True)
class StandIns:
    """A built set of stand-ins: where, which libraries in load order, and whether this call built them."""

    directory: Path
    libraries: tuple[str, ...]
    symbols: int
    built: bool
    top: Path  # the cache's own top directory (``$XDG_CACHE_HOME/k3_tail``, or the root given): all of it yours


# What is loaded must be yours, as OpenSSH has it of its files. The cache's own directories and files (its top,
# ``$XDG_CACHE_HOME/k3_tail``, and everything below it) must be your own real directories and regular files, not
# writable by group or others. The directories above the top, up to your home directory (or / outside it), must be
# yours or root's and not writable by group or others unless sticky (/tmp: others cannot rename what is yours
# there): whoever can rename a directory on the path can put another cache in place of the checked one.
_ELSEWHERE = "set XDG_CACHE_HOME to an absolute directory of your own"


def check_trusted(path: Path, *, directory: bool, own: bool) -> bool:
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


def check_trusted_path(directory: Path, top: Path) -> bool:
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
        if not check_trusted(level, directory=True, own=is_own):
            return False
    return True


def make_directories(directory: Path, top: Path) -> None:
    """Make the missing levels of ``directory``, each 0700, and check the whole path."""
    missing = list(itertools.takewhile(lambda level: not os.path.lexists(level), [directory, *directory.parents]))
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:  # another process made it: checked below
            pass
        except OSError as error:
            check_trusted_path(directory, top)  # names a level in the way (a file where a directory belongs)
            raise RocmUnavailable(f"cannot make the stand-in cache directory {level}: {error}") from error
    check_trusted_path(directory, top)


def locations(root: Path | None) -> tuple[Path, Path]:
    """(where the stand-in directories go, the cache's top), symbolic links up to the top resolved (the checks
    then see the directories that hold the cache, not the links)."""
    if root is None:
        top = Path(os.path.realpath(cache_home() / "k3_tail"))
        return top / "rocm-stand-ins", top
    root = Path(os.path.realpath(root))
    return root, root


def cached_stand_ins(directory: Path, top: Path) -> tuple[tuple[str, ...], int] | None:
    """(libraries, symbols) of the stand-ins in ``directory`` (None when it does not exist), from its manifest;
    RocmUnavailable naming what is not to trust or malformed, and the fix."""
    if not check_trusted_path(directory, top):
        return None
    path = directory / MANIFEST
    fix = f"remove {directory} (the stand-ins are rebuilt)"
    if not check_trusted(path, directory=False, own=True):
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
        if SONAME.fullmatch(soname) is None:
            raise RocmUnavailable(f"the stand-in manifest {path} lists the library {soname!r}, not a plain soname in "
                                  f"its directory (no path, separator or '..'): {fix}")
    if type(symbols) is not int or symbols < 0:
        raise RocmUnavailable(f"the stand-in manifest {path}: 'symbols' is {symbols!r}, not a count: {fix}")
    return tuple(libraries), symbols
