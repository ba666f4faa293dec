"""Where outputs go (k3_tail/output_files.py): every output path checked before any work, files written whole.

Each kind of path no output can go to (a missing directory, a directory, a FIFO, a device, a /proc file, a path
under a file) is refused by the shared check, once per kind; each entry point that writes is shown to use it
with one kind, in a covering rather than a full product: SelectionTable.save, compile_tail(dump_to=), and
the commands and scripts, which exit 2 before measuring.
"""

import os
import stat

import jax.numpy as jnp
import pytest

import k3_tail
import k3_tail.xla.compilation
from helpers import make_tp_mesh
from k3_tail.cli import main
from k3_tail.output_files import check_output_directory, check_output_file, write_file
from k3_tail.selection.table import TokenRange

TABLE = k3_tail.SelectionTable(device_kind="cpu", tp_size=2, weight_layout="column", hidden_size=16, latent_size=8,
                               dtype="bfloat16", ranges=(TokenRange(1, None, k3_tail.Tier.OVERLAP),))


def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("old")
    return path


# Each kind of path no file can be written to: (its path in tmp_path, what the message says).
UNWRITABLE = {
    "missing-directory": (lambda tmp_path: tmp_path / "missing" / "out.json", "no such directory"),
    "directory": (lambda tmp_path: tmp_path, r"is not a regular file \(a directory\)"),
    "fifo": (fifo, r"is not a regular file \(a FIFO\)"),
    "device": (lambda _: "/dev/null", r"is not a regular file \(a character device\)"),
    "proc-file": (lambda _: "/proc/version", "no new file can be made in '/proc'"),
    "under-a-file": (lambda tmp_path: a_file(tmp_path) / "out.json", "Not a directory"),
}


@pytest.mark.parametrize("kind", UNWRITABLE)
def test_a_path_no_file_can_be_written_to_is_a_value_error_naming_the_argument(kind, tmp_path):
    make, message = UNWRITABLE[kind]
    with pytest.raises(ValueError, match=rf"^out: .*{message}"):
        check_output_file("out", make(tmp_path))


def test_a_file_that_can_be_written_is_taken_and_left_untouched(tmp_path):
    existing = a_file(tmp_path)
    assert check_output_file("out", existing) == str(existing) and existing.read_text() == "old"
    assert check_output_file("out", tmp_path / "new.json") == str(tmp_path / "new.json")
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the probe file is gone


def test_a_write_replaces_the_file_whole_and_keeps_its_permission_bits(tmp_path):
    path = a_file(tmp_path)
    path.chmod(0o640)
    write_file("out", path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = a_file(tmp_path)

    def full_disk(_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(ValueError, match="^out: cannot write .*No space left on device; the file is as it was"):
        write_file("out", path, "new")
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["file"]


def test_a_write_through_a_symbolic_link_replaces_the_file_it_names(tmp_path):
    target = a_file(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(target)
    write_file("out", link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_selection_table_save_onto_a_fifo_is_refused_without_blocking(tmp_path):
    with pytest.raises(ValueError, match=r"^selection_table: .* is not a regular file \(a FIFO\)"):
        TABLE.save(fifo(tmp_path))


def test_selection_table_save_writes_what_load_reads(tmp_path):
    TABLE.save(tmp_path / "table.json")
    assert k3_tail.SelectionTable.load(tmp_path / "table.json") == TABLE


@pytest.mark.parametrize("kind", ["fifo", "under-a-file"])
def test_a_dump_directory_that_cannot_be_one_is_refused_before_compiling(kind, tmp_path, monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(k3_tail.xla.compilation, "lowered_tail", no_compile)
    path = UNWRITABLE[kind][0](tmp_path)
    config = k3_tail.TailConfig(hidden_size=16, latent_size=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="^dump_to: "):
        k3_tail.compile_tail(config, make_tp_mesh(2), 1, dump_to=path)


def test_a_dump_directory_onto_a_file_is_refused_naming_dump_to(tmp_path):
    with pytest.raises(ValueError, match=r"^dump_to: .* is not a directory \(another kind of file\)"):
        check_output_directory("dump_to", a_file(tmp_path))


def test_a_missing_dump_directory_is_made_with_its_parents(tmp_path):
    path = tmp_path / "a" / "b"
    assert check_output_directory("dump_to", path) == str(path) and path.is_dir()


def command_error(argv, capsys):
    """(exit status, stdout, stderr) of ``k3-tail`` with ``argv`` in this process."""
    try:
        status = main(argv)
    except SystemExit as exit_info:
        status = exit_info.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize(("argv", "kind", "flag"), [
    (["bench", "--json"], "directory", "--json"),
    (["bench", "--csv"], "proc-file", "--csv"),
    (["bench", "--plot"], "fifo", "--plot"),
    (["calibrate", "--out"], "device", "--out"),
])
def test_a_command_refuses_an_output_it_cannot_write_before_measuring(argv, kind, flag, tmp_path, capsys):
    make, message = UNWRITABLE[kind]
    status, out, error = command_error([*argv, str(make(tmp_path)), "--tokens", "1"], capsys)
    assert status == 2 and out == "" and "Traceback" not in error  # nothing measured, nothing printed
    assert error.startswith(f"k3-tail {argv[0]}: error: {flag}") and message.replace("\\", "") in error
