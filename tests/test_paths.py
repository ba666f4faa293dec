"""Paths no file can have, at every entry point that takes one: a ValueError naming the argument and the path.

A NUL byte ends a C string, a character the file system's encoding cannot encode (under UTF-8 a lone
surrogate such as U+D800, which surrogateescape does not give back as a byte) has no bytes to ask the
system for, and a name longer than the file system takes is its ENAMETOOLONG: each would otherwise surface
as "embedded null byte", a UnicodeEncodeError or an OSError, naming none.
Every entry point refuses them with one check (k3_tail._checks.check_path).
"""

import json
import os
import re

import pytest

import k3_tail
from helpers import make_tp_mesh
from k3_tail import hf_config
from k3_tail.checkpoint import Checkpoint
from k3_tail.json_files import read_json
from k3_tail.selection.table import TokenRange

CONFIG = k3_tail.TailConfig(hidden_size=16, latent_size=8)
TABLE = k3_tail.SelectionTable(device_kind="cpu", tp_size=2, weight_layout="column", hidden_size=16, latent_size=8,
                               dtype="bfloat16", ranges=(TokenRange(1, None, k3_tail.Tier.OVERLAP),))
UNENCODABLE = "\ud800"
# A name longer than the 255 bytes a Linux file system takes: the system's ENAMETOOLONG, named by the argument.
NAMES = {"nul-byte": "tail\0.json", "unencodable": f"tail{UNENCODABLE}.json", "too-long": "t" * 300 + ".json"}


def index_naming(directory, shard):
    """A checkpoint directory whose index maps one tensor to the shard file ``shard``."""
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.layers.0.a": shard}}))
    return directory


# Each entry point: (a call of it with the path, in a fresh directory; the argument its message names, a regex).
ENTRY_POINTS = {
    "read_json": (lambda path, _: read_json(path, what="config"), "config"),
    "TailConfig.from_hf_config": (lambda path, _: k3_tail.TailConfig.from_hf_config(path), "config"),
    "hf_config.moe_layers": (lambda path, _: hf_config.moe_layers(path), "config"),
    "load_tail_weights": (lambda path, _: k3_tail.load_tail_weights(path, 1, config=CONFIG, mesh=make_tp_mesh(2)),
                          "checkpoint"),
    "LatentMoETail.from_checkpoint": (
        lambda path, _: k3_tail.LatentMoETail.from_checkpoint(path, 1, config=CONFIG, mesh=make_tp_mesh(2)),
        "checkpoint"),
    "Checkpoint": (lambda path, _: Checkpoint(path), "checkpoint"),
    "the index's shard name": (lambda shard, directory: Checkpoint(index_naming(directory, shard)),
                               r"checkpoint: '.*model\.safetensors\.index\.json': weight_map\.model\.layers\.0\.a"),
    "SelectionTable.load": (lambda path, _: k3_tail.SelectionTable.load(path), "selection_table"),
    "SelectionTable.save": (lambda path, _: TABLE.save(path), "selection_table"),
    "compile_tail(dump_to=)": (lambda path, _: k3_tail.compile_tail(CONFIG, make_tp_mesh(2), 1, dump_to=path),
                               "dump_to"),
    "report(dump_dir=)": (lambda path, _: k3_tail.xla.report.report(
        k3_tail.compile_tail(CONFIG, make_tp_mesh(2), 1), dump_dir=path), "dump_dir"),
}


def test_the_unencodable_name_is_one_the_file_system_refuses():
    with pytest.raises(UnicodeEncodeError):
        os.fsencode(NAMES["unencodable"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_a_path_no_file_can_have_is_a_value_error_naming_the_argument(entry_point, name, tmp_path):
    call, argument = ENTRY_POINTS[entry_point]
    path = NAMES[name]
    with pytest.raises(ValueError, match=rf"^{argument}: {re.escape(repr(path))} (holds a NUL byte|cannot be a file "
                                         r"name here)"):
        call(path, tmp_path)
