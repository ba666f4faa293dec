"""What the ROCm stand-in cache trusts (k3_tail.deviceless.rocm_stand_ins): where it is, who may own and write each
level of it, what its manifest may say and which names from the plugin's ELF files may reach the generated C. Most
tests use a hand-made cache under a private XDG_CACHE_HOME and need neither the ROCm plugin nor gcc."""

import json
import os
import re
from pathlib import Path

import pytest

from k3_tail.deviceless import rocm_stand_ins
from k3_tail.deviceless.rocm_stand_ins import ElfNeeds, RocmUnavailable
from rocm_stand_in_helpers import PRINT_TOPOLOGY_ERROR, build_fake_plugin, needs_rocm_wheels, needs_tools, run_python

LIBRARY = "libk3trust.so.1"


def e(path):
    """``path`` (or a name) as a regular expression matching it."""
    return re.escape(str(path))


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A private, absolute XDG_CACHE_HOME."""
    home = tmp_path / "xdg"
    home.mkdir(0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def fake_plugin(tmp_path):
    """A plugin whose one file only needs to exist: the cache is keyed by its size and time."""
    (tmp_path / "plugin.so").write_bytes(b"not read")
    return rocm_stand_ins.Plugin("0.0.test", tmp_path / "plugin.so", ())


def make_cache(plugin, manifest=None):
    """The cache a finished build leaves for ``plugin`` (its levels 0700, a library file that is never loaded
    here), without building: its stand-in directory."""
    directory = rocm_stand_ins.cache_root() / f"{plugin.version}-{plugin.digest()}"
    for level in reversed([directory, *directory.parents][:3]):
        level.mkdir(0o700)
    (directory / rocm_stand_ins.MANIFEST).write_text(json.dumps(manifest or {"libraries": [LIBRARY], "symbols": 1}))
    (directory / LIBRARY).write_bytes(b"\x7fELF stand-in")
    for path in directory.iterdir():
        path.chmod(0o600)
    return directory


def refused(plugin, match):
    """stand_ins and then preload refuse the cache, with a message that matches ``match``."""
    with pytest.raises(RocmUnavailable, match=match):
        rocm_stand_ins.preload(rocm_stand_ins.stand_ins(plugin))


def pretend_owner(monkeypatch, path, uid):
    """os.lstat reports ``path`` as owned by ``uid`` (another user's files, without being root)."""
    real_lstat = os.lstat

    def lstat(target, *args, **kwargs):
        status = real_lstat(target, *args, **kwargs)
        if os.fspath(target) != os.fspath(path):
            return status
        return os.stat_result((*status[:4], uid, *status[5:10]))

    monkeypatch.setattr(os, "lstat", lstat)


# --- where the cache is -----------------------------------------------------------------------------------------


def test_an_absolute_xdg_cache_home_holds_the_cache(cache_home):
    assert rocm_stand_ins.cache_root() == cache_home / "k3_tail" / "rocm-stand-ins"


@pytest.mark.parametrize("value", ["", "relative/cache", "."])
def test_a_relative_or_empty_xdg_cache_home_is_ignored_for_the_home_cache(value, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", value)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert rocm_stand_ins.cache_root() == tmp_path / ".cache" / "k3_tail" / "rocm-stand-ins"


def test_without_an_absolute_cache_or_home_directory_none_is_used(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    monkeypatch.setenv("HOME", "home")
    with pytest.raises(RocmUnavailable, match=r"XDG_CACHE_HOME is unset or relative and so is the home directory "
                                              r"\('home'\): set XDG_CACHE_HOME to an absolute directory"):
        rocm_stand_ins.cache_root()


# --- who owns and writes it ---------------------------------------------------------------------------------------


def test_a_good_cache_is_used_without_building(cache_home, tmp_path, monkeypatch):
    plugin = fake_plugin(tmp_path)
    directory = make_cache(plugin)
    monkeypatch.setattr(rocm_stand_ins, "find_tools", lambda: pytest.fail("built again"))
    built = rocm_stand_ins.stand_ins(plugin)
    assert (built.directory, built.libraries, built.symbols, built.built) == (directory, (LIBRARY,), 1, False)
    assert built.top == cache_home / "k3_tail"


@needs_tools
def test_a_build_makes_every_level_0700_and_its_files_private_whatever_the_umask(tmp_path, monkeypatch):
    plugin = build_fake_plugin(tmp_path)
    home = tmp_path / "new" / "xdg"  # neither exists yet
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    umask = os.umask(0o002)
    try:
        built = rocm_stand_ins.stand_ins(plugin)
    finally:
        os.umask(umask)
    assert built.built and built.libraries == ("libk3fake.so.1", "libk3plain.so.2")
    levels = [built.directory, *built.directory.parents][:5]
    assert levels[-1] == tmp_path / "new"
    assert {path.name: oct(path.stat().st_mode & 0o777) for path in levels} == {path.name: "0o700" for path in levels}
    assert [path.name for path in built.directory.iterdir() if path.stat().st_mode & 0o077] == []
    assert not rocm_stand_ins.stand_ins(plugin).built


@pytest.mark.parametrize("level", [0, 1, 2], ids=["stand-in directory", "rocm-stand-ins", "k3_tail"])
@pytest.mark.parametrize("mode", [0o720, 0o702, 0o1777], ids=["group", "others", "sticky"])
def test_a_level_of_the_cache_writable_by_group_or_others_is_refused(level, mode, cache_home, tmp_path):
    plugin = fake_plugin(tmp_path)
    directory = make_cache(plugin)
    path = [directory, *directory.parents][level]
    path.chmod(mode)
    refused(plugin, f"{e(path)} \\(in the stand-in cache\\) is writable by group or others.*: chmod go-w {e(path)}$")


@pytest.mark.parametrize("name", [rocm_stand_ins.MANIFEST, LIBRARY])
def test_a_file_of_the_cache_writable_by_others_is_refused_and_its_directory_named_for_removal(name, cache_home,
                                                                                               tmp_path):
    plugin = fake_plugin(tmp_path)
    directory = make_cache(plugin)
    (directory / name).chmod(0o622)
    refused(plugin, f"{e(directory / name)} .* writable by group or others.*: remove {e(directory)} ")


@pytest.mark.parametrize("level", ["stand-in directory", "k3_tail", rocm_stand_ins.MANIFEST, LIBRARY])
def test_what_another_user_owns_in_the_cache_is_refused(level, cache_home, tmp_path, monkeypatch):
    plugin = fake_plugin(tmp_path)
    directory = make_cache(plugin)
    path = {"stand-in directory": directory, "k3_tail": cache_home / "k3_tail"}.get(level, directory / level)
    pretend_owner(monkeypatch, path, os.geteuid() + 1)
    refused(plugin, f"{e(path)} \\(in the stand-in cache\\) is owned by uid {os.geteuid() + 1}, not by you .*: remove")


@pytest.mark.parametrize("level", ["stand-in directory", LIBRARY])
def test_a_symbolic_link_in_the_cache_is_refused(level, cache_home, tmp_path):
    plugin = fake_plugin(tmp_path)
    directory = make_cache(plugin)
    path = directory if level == "stand-in directory" else directory / level
    elsewhere = tmp_path / "elsewhere"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    refused(plugin, f"{e(path)} \\(in the stand-in cache\\) is a symbolic link.*: remove")


@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["stand-in directory", "rocm-stand-ins", "k3_tail", "xdg"])
def test_a_file_where_a_directory_of_the_cache_belongs_is_refused(level, cache_home, tmp_path):
    """(Not a NotADirectoryError.)"""
    plugin = fake_plugin(tmp_path)
    directory = rocm_stand_ins.cache_root() / f"{plugin.version}-{plugin.digest()}"
    levels = [directory, *directory.parents]
    cache_home.rmdir()
    for directory in reversed(levels[level + 1:4]):
        directory.mkdir(0o700)
    levels[level].write_text("")
    fix = "set XDG_CACHE_HOME" if level == 3 else "remove it"
    refused(plugin, f"{e(levels[level])} \\(.* the stand-in cache\\) is not a directory, where a directory belongs: "
                    + fix)


@pytest.mark.parametrize(("mode", "trusted"), [(0o755, True), (0o1777, True), (0o775, False), (0o757, False)])
def test_a_directory_above_the_cache_may_be_writable_by_others_only_when_sticky(mode, trusted, cache_home, tmp_path):
    plugin = fake_plugin(tmp_path)
    make_cache(plugin)
    cache_home.chmod(mode)
    if trusted:
        assert rocm_stand_ins.stand_ins(plugin).libraries == (LIBRARY,)
    else:
        refused(plugin, f"{e(cache_home)} \\(above the stand-in cache\\) is writable by group or others.*: chmod go-w "
                        f"{e(cache_home)}, or set XDG_CACHE_HOME")


@pytest.mark.parametrize(("owner", "trusted"), [(0, True), (os.geteuid() + 1, False)], ids=["root", "another"])
def test_a_directory_above_the_cache_may_be_roots(owner, trusted, cache_home, tmp_path, monkeypatch):
    plugin = fake_plugin(tmp_path)
    make_cache(plugin)
    pretend_owner(monkeypatch, cache_home, owner)
    if trusted:
        assert rocm_stand_ins.stand_ins(plugin).libraries == (LIBRARY,)
    else:
        refused(plugin, f"{e(cache_home)} \\(above the stand-in cache\\) is owned by uid {owner}.* or root: "
                        "set XDG_CACHE_HOME")


# --- what its manifest says -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "match"), [
    (b'{"libraries": [', "does not read as JSON"),
    (b'{"libraries": ["\xff"], "symbols": 1}', "does not read as JSON"),
    (b"[" * 100_000, "does not read as JSON"),
    (b'["libk3trust.so.1"]', "is not a JSON object"),
    (b'{"symbols": 1}', "'libraries' is None, not a list of sonames"),
    (b'{"libraries": [1], "symbols": 1}', "'libraries' is \\[1\\], not a list of sonames"),
    (b'{"libraries": [], "symbols": true}', "'symbols' is True, not a count"),
])
def test_a_malformed_manifest_is_named_for_removal(text, match, cache_home, tmp_path):
    plugin = fake_plugin(tmp_path)
    directory = make_cache(plugin)
    (directory / rocm_stand_ins.MANIFEST).write_bytes(text)
    refused(plugin, f"{e(directory / rocm_stand_ins.MANIFEST)}.*{match}.*: remove {e(directory)} ")


def test_a_stand_in_directory_without_a_manifest_is_named_for_removal(cache_home, tmp_path):
    plugin = fake_plugin(tmp_path)
    directory = make_cache(plugin)
    (directory / rocm_stand_ins.MANIFEST).unlink()
    refused(plugin, f"{e(directory)} has no {rocm_stand_ins.MANIFEST}: .*remove {e(directory)} ")


@pytest.mark.parametrize("entry", ["/usr/lib/libk3trust.so.1", "../libk3trust.so.1", "sub/libk3trust.so.1", "..",
                                   ".libk3trust.so.1"])
def test_a_manifest_library_that_is_not_a_plain_soname_is_refused(entry, cache_home, tmp_path):
    plugin = fake_plugin(tmp_path)
    directory = make_cache(plugin, {"libraries": [entry], "symbols": 1})
    refused(plugin, f"lists the library '{e(entry)}', not a plain soname in its directory .*: remove {e(directory)} ")


def test_a_library_the_manifest_lists_but_the_cache_lacks_is_named(cache_home, tmp_path):
    plugin = fake_plugin(tmp_path)
    directory = make_cache(plugin)
    (directory / LIBRARY).unlink()
    refused(plugin, f"the stand-in {e(directory / LIBRARY)} is missing: remove {e(directory)} ")


# --- which names reach the generated C ----------------------------------------------------------------------------


def needs_of(name="k3trust_call", version=None, soname="libk3absent.so.1"):
    """One ELF file needing ``name`` (at ``version``) from ``soname``, which is not on this machine."""
    versions = {2: (soname, version)} if version else {}
    return ElfNeeds(Path("/plugin/fake.so"), (soname,), versions, ((name, "FUNC", 2 if version else None),))


@pytest.mark.parametrize("name", ["_ZN4hipx6launchEPv", "k3trust_call.cold", "k3trust$call", "_start2"])
def test_symbol_names_of_letters_digits_and_underscore_dollar_dot_reach_c_as_they_are(name):
    (library,), _ = rocm_stand_ins.plan_stand_ins([needs_of(name)])
    assert f'__asm__("{name}")' in rocm_stand_ins.c_source(library)


@pytest.mark.parametrize("name", ['k3trust"); system("id', "k3trust*", "9lives", ".k3trust", "$k3trust",
                                  "k3 trust", "k3trust\n", "", "k3trust@V1"])
def test_a_symbol_name_that_no_stand_in_can_define_is_refused(name):
    with pytest.raises(RocmUnavailable, match=r"/plugin/fake.so needs the symbol .*which no stand-in defines"):
        rocm_stand_ins.plan_stand_ins([needs_of(name)])


@pytest.mark.parametrize("version", ["K3 { global: *; }", "1.0", "V-1"])
def test_a_symbol_version_that_no_stand_in_can_define_is_refused(version):
    with pytest.raises(RocmUnavailable, match=r"needs the symbol version .*which no stand-in defines"):
        rocm_stand_ins.plan_stand_ins([needs_of(version=version)])


@pytest.mark.parametrize("soname", ["../libk3absent.so.1", "libk3absent.so.1,-rpath,/tmp", ".libk3absent.so"])
def test_a_library_name_that_no_stand_in_can_take_is_refused(soname):
    with pytest.raises(RocmUnavailable, match=r"needs the library .*which no stand-in defines"):
        rocm_stand_ins.plan_stand_ins([needs_of(soname=soname)])


def test_versioned_symbols_reach_the_version_script_under_their_version():
    (library,), _ = rocm_stand_ins.plan_stand_ins([needs_of("k3trust_call", "K3TRUST_1.0")])
    assert rocm_stand_ins.version_script(library) == "K3TRUST_1.0 { global: k3trust_call; };\n"


# --- through topology_mesh ----------------------------------------------------------------------------------------


@needs_rocm_wheels
def test_a_rocm_topology_over_an_untrusted_cache_is_topology_unavailable(tmp_path):
    """In a fresh process (nothing registered yet), a group-writable cache refuses before anything is built."""
    (tmp_path / "k3_tail").mkdir(0o770)
    (tmp_path / "k3_tail").chmod(0o770)
    result = run_python(PRINT_TOPOLOGY_ERROR, XDG_CACHE_HOME=str(tmp_path))
    assert result.returncode == 0 and result.stderr == "", result
    assert result.stdout == (f"cannot compile for 'mi300xx8' here: {tmp_path / 'k3_tail'} (in the stand-in cache) is "
                             "writable by group or others, who could replace the stand-in ROCm libraries: chmod go-w "
                             f"{tmp_path / 'k3_tail'}\n")
    assert [path.name for path in tmp_path.iterdir()] == ["k3_tail"]
