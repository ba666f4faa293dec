"""Where outputs go: each output path checked before any work, and each file written whole or not at all.

An entry point that writes checks its paths before it measures, compiles or computes anything: ValueError
naming the argument. A file path must be a regular file or none yet, in a directory that takes a new file (tried:
one made and removed, which catches /proc and read-only mounts that no permission bit tells).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from typing import Any

from k3_tail._checks import check_path
from k3_tail.json_files import file_kind

_NEW_FILE_MODE = 0o666  # what open() asks for a new file; the umask applies


def check_output_file(name: str, path: Any, *, expected: str = "a path to write a file to") -> str:
    """``path`` as a str when a file can be written there (module docstring), else ValueError naming ``name``."""
    text = check_path(name, path, expected=expected)
    target = os.path.realpath(text)
    try:
        status = os.stat(target)
    except FileNotFoundError:
        status = None
    except OSError as error:  # a path under a file (ENOTDIR), a symbolic link loop, ...
        raise ValueError(f"{name}: cannot write {text!r}: {error.strerror}") from None
    if status is not None and not stat.S_ISREG(status.st_mode):
        raise ValueError(f"{name}: {text!r} is not a regular file ({file_kind(status.st_mode)}); nothing written")
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise ValueError(f"{name}: no such directory ({directory!r})")
    descriptor, probe = _new_file_beside(name, text, target)
    os.close(descriptor)
    os.unlink(probe)
    if status is not None and not os.access(target, os.W_OK):  # replaceable, but open() would refuse it
        raise ValueError(f"{name}: cannot write {text!r}: permission denied")
    return text


def write_file(name: str, path: Any, data: str | bytes) -> None:
    """Write ``data`` (a str as UTF-8) to ``path`` atomically: a new file beside it, flushed, renamed over it
    (a link's target replaced, the old file's mode kept); a failure leaves the old file. ValueError naming
    ``name`` when it cannot be written."""
    text = check_output_file(name, path)
    target = os.path.realpath(text)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    descriptor, temporary = _new_file_beside(name, text, target)
    try:
        with open(descriptor, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())  # the data on the disk before the rename makes it the file
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise ValueError(f"{name}: cannot write {text!r}: {error.strerror}; the file is as it was") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def check_output_directory(name: str, path: Any, *, expected: str = "a directory to write files into") -> str:
    """``path`` as a str once it is a directory, created with its parents when absent; ValueError naming ``name``
    when it is something else or cannot be created."""
    text = check_path(name, path, expected=expected)
    try:
        os.makedirs(text, exist_ok=True)
    except FileExistsError:  # makedirs takes an existing directory; anything else there is this error
        try:
            kind = file_kind(os.stat(text).st_mode)
        except OSError:
            kind = "a symbolic link to nothing"
        raise ValueError(f"{name}: {text!r} is not a directory ({kind}); expected {expected}") from None
    except OSError as error:
        raise ValueError(f"{name}: cannot create the directory {text!r}: {error.strerror}") from None
    if not os.access(text, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: cannot write into the directory {text!r}: permission denied")
    return text


def _new_file_beside(name: str, text: str, target: str) -> tuple[int, str]:
    """(a descriptor open for writing, the path) of a new hidden file in ``target``'s directory; ValueError naming
    ``name`` and ``text`` when none can be made there."""
    directory, base = os.path.split(target)
    temporary = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                             _NEW_FILE_MODE)
    except OSError as error:
        raise ValueError(f"{name}: cannot write {text!r}: no new file can be made in {directory!r} "
                         f"({error.strerror})") from None
    return descriptor, temporary
