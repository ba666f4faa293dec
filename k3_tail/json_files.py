"""Strict JSON files: the one reader of a model's config.json, a checkpoint's index and a selection table.

:func:`read_json` reads RFC 8259 JSON and nothing looser, every failure a ValueError naming the file (and the
field): a path no file can have; anything but a regular file (refused before a byte is read, never blocking on a
FIFO); more than ``max_bytes``; text that is not UTF-8; a key given twice in one object (``json`` keeps the last);
NaN, Infinity, a number beyond float64 (``1e400``) or an integer of more than ``MAX_INTEGER_DIGITS`` digits;
nesting too deep for the parser. It imports only :mod:`k3_tail._checks`; the write side is
:mod:`k3_tail.output_files`.
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

from k3_tail._checks import check_path

# The largest JSON file read: four times the released Kimi-K3's checkpoint index (about 60 MB).
MAX_JSON_BYTES = 256 * 2**20
# Python's default limit on an integer's digits, applied whatever the interpreter is set to.
MAX_INTEGER_DIGITS = 4300


def read_json(path: Any, *, what: str, field_prefix: str = "", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in the file at ``path`` (a str or os.PathLike; links followed): module docstring.
    ``what`` starts every message ("config"); ``field_prefix`` goes before a field's path
    (``"selection_table."``).

    Raises:
      ValueError: ``"<what>: '<path>' ..."`` when the file cannot be opened, is no regular file, is larger
        than ``max_bytes``, is not UTF-8 or not JSON; ``"<field>: duplicate key ... (in '<path>')"`` for a
        key given twice in one object.
    """
    name = check_path(what, path, expected="the path of a JSON file")
    raw = _read_regular_file(name, what=what, max_bytes=max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{what}: {name!r} is not UTF-8 (byte {error.start}: {error.reason})") from None
    duplicates: list[_Duplicates] = []

    def object_from_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value = dict(pairs)
        if len(value) == len(pairs):
            return value
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        marked = _Duplicates(value, key=repeated)
        duplicates.append(marked)
        return marked

    try:
        value = json.loads(text, object_pairs_hook=object_from_pairs, parse_constant=_refuse_constant,
                           parse_float=_finite_float, parse_int=_bounded_int)
    except RecursionError:
        raise ValueError(f"{what}: {name!r} nests arrays and objects deeper than the JSON parser goes") from None
    except ValueError as error:  # JSONDecodeError, and the hooks' refusals
        raise ValueError(f"{what}: {name!r} is not JSON ({error})") from None
    if duplicates:
        field, key = _first_duplicate(value)
        raise ValueError(f"{field_prefix}{field}{'.' if field else ''}{key}: duplicate key (one JSON object gives "
                         f"it more than once) (in {name!r})")
    return value


def _read_regular_file(name: str, *, what: str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``name``, at most ``max_bytes`` of them; ValueError otherwise."""
    try:
        descriptor = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise ValueError(f"{what}: cannot read {name!r}: {error.strerror}") from None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"{what}: {name!r} is not a regular file ({file_kind(status.st_mode)}); not read")
        if status.st_size > max_bytes:
            raise ValueError(f"{what}: {name!r} holds more than the {max_bytes}-byte limit of a JSON file read "
                             f"here ({status.st_size} bytes); not read")
        with open(descriptor, "rb", closefd=False) as file:
            raw = file.read(status.st_size + 1)  # one byte more tells a file that grew since fstat
    except OSError as error:
        raise ValueError(f"{what}: cannot read {name!r}: {error.strerror}") from None
    finally:
        os.close(descriptor)
    if len(raw) != status.st_size:
        raise ValueError(f"{what}: {name!r} changed size while it was read; not parsed")
    return raw


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for a message: "a directory", "a FIFO", "a character device", ..."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "another kind of file")


class _Duplicates(dict):
    """A JSON object that gave ``key`` more than once (json's object_pairs_hook kept the last value)."""

    def __init__(self, value: dict[str, Any], *, key: str):
        super().__init__(value)
        self.key = key


def _first_duplicate(value: Any) -> tuple[str, str]:
    """(the path of the first object, in document order, that repeats a key; that key), walked with a stack of
    its own: it may nest as deep as the parser went."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, _Duplicates):
            return where, item.key
        if isinstance(item, dict):
            children = [(f"{where}{'.' if where else ''}{key}", child) for key, child in item.items()]
        elif isinstance(item, list):
            children = [(f"{where}[{index}]", child) for index, child in enumerate(item)]
        else:
            continue
        stack.extend(reversed(children))
    raise AssertionError("no object repeats a key")  # read_json calls this only when one does


def _refuse_constant(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON number")


def _finite_float(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise ValueError(f"the number {literal[:40]} is beyond float64's range")
    return number


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise ValueError(f"an integer of {len(literal.lstrip('-'))} digits, more than the {MAX_INTEGER_DIGITS} "
                         f"read here")
    return int(literal)
