"""The strict JSON reader (k3_tail/json_files.py) that reads config.json, checkpoint indexes and selection tables.

Each way a file can fail is one case here, read through ``read_json`` itself; the tests of its users
(test_hf_config.py, test_checkpoint.py, test_kimi_k3_checkpoint.py, test_calibration.py) check that each of them reads
through it, with one failure each.
"""

import os

import pytest

from k3_tail.json_files import MAX_INTEGER_DIGITS, read_json


def write(tmp_path, content):
    path = tmp_path / "file.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_a_json_file_reads_as_json_loads_reads_it(tmp_path):
    text = '{"a": [1, 2.5, "x", null, true, {"b": -3}], "é": "ü"}'
    assert read_json(write(tmp_path, text), what="config") == {"a": [1, 2.5, "x", None, True, {"b": -3}], "é": "ü"}


def test_a_symbolic_link_is_followed(tmp_path):
    (tmp_path / "link.json").symlink_to(write(tmp_path, "[1]"))
    assert read_json(tmp_path / "link.json", what="config") == [1]


@pytest.mark.parametrize(("content", "message"), [
    ('{"a": {"b": [{"c": 1, "c": 2}]}}', r"^a\.b\[0\]\.c: duplicate key \(one JSON object gives it more than once\) "
                                         r"\(in '.*file\.json'\)$"),
    ('{"a": 1, "a": 2}', r"^a: duplicate key"),
    (b'{"a": "\xe9"}', r"^config: '.*file\.json' is not UTF-8 \(byte 7: invalid continuation byte\)$"),
    ('{"a": 1}'.encode("utf-16"), r"^config: '.*file\.json' is not UTF-8"),
    ("[" * 100_000 + "]" * 100_000, r"^config: '.*file\.json' nests arrays and objects deeper than the JSON parser"),
    ('{"a": ' + "7" * (MAX_INTEGER_DIGITS + 1) + "}", rf"^config: '.*' is not JSON \(an integer of "
                                                     rf"{MAX_INTEGER_DIGITS + 1} digits, more than the "
                                                     rf"{MAX_INTEGER_DIGITS} read here\)$"),
    ('{"a": NaN}', r"^config: '.*' is not JSON \(NaN is not a JSON number\)$"),
    ("[-Infinity]", r"is not JSON \(-Infinity is not a JSON number\)$"),
    ('{"eps": 1e400}', r"is not JSON \(the number 1e400 is beyond float64's range\)$"),
    ('{"a": 1,}', r"^config: '.*' is not JSON \(Expecting property name enclosed in double quotes: line 1 column 9"),
    ("", r"^config: '.*' is not JSON \(Expecting value: line 1 column 1"),
], ids=["duplicate-nested", "duplicate-top", "latin-1", "utf-16", "deep", "digits", "nan", "infinity", "overflow",
        "trailing-comma", "empty"])
def test_what_is_not_strict_json_is_a_value_error_naming_the_file_and_the_field(content, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        read_json(write(tmp_path, content), what="config")


def test_a_field_prefix_goes_before_the_fields_path(tmp_path):
    path = write(tmp_path, '{"ranges": [{"tier": 1, "tier": 2}]}')
    with pytest.raises(ValueError, match=r"^selection_table\.ranges\[0\]\.tier: duplicate key"):
        read_json(path, what="selection_table", field_prefix="selection_table.")


def test_a_file_over_the_limit_is_refused_before_it_is_parsed(tmp_path):
    path = write(tmp_path, " " * 101)  # no JSON at all: parsing would fail otherwise
    with pytest.raises(ValueError, match=r"^config: '.*file\.json' holds more than the 100-byte limit"):
        read_json(path, what="config", max_bytes=100)
    assert read_json(write(tmp_path, "[" + " " * 98 + "]"), what="config", max_bytes=100) == []


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_only_a_regular_file_is_read_and_a_fifo_does_not_block(kind, tmp_path, fails_if_blocked):
    path = tmp_path / "not-a-file.json"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    expected = "a FIFO" if kind == "fifo" else "a directory"
    with pytest.raises(ValueError, match=rf"^config: '.*not-a-file\.json' is not a regular file \({expected}\)"):
        read_json(path, what="config")


@pytest.mark.parametrize(("path", "message"), [
    ("", r"^config: expected the path of a JSON file, got ''$"),
    (None, r"^config: expected the path of a JSON file, got None$"),
    ("missing.json", r"^config: cannot read 'missing\.json': No such file or directory$"),
], ids=["empty", "none", "missing"])
def test_a_path_that_names_no_file_is_a_value_error(path, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        read_json(path, what="config")


def test_a_selection_table_on_a_fifo_is_refused_without_blocking(tmp_path, fails_if_blocked):
    from k3_tail.selection.table import SelectionTable

    os.mkfifo(tmp_path / "table.json")
    with pytest.raises(ValueError, match=r"^selection_table: '.*table\.json' is not a regular file \(a FIFO\)"):
        SelectionTable.load(tmp_path / "table.json")
