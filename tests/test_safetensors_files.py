"""Files in safetensors' layout written byte by byte: each that safetensors (the reader under
k3_tail.checkpoint.Checkpoint) refuses is a ValueError naming the file with safetensors' own reason, and each it
accepts reads as safetensors reads it."""

import json
import re
import struct

import numpy as np
import pytest
from safetensors import SafetensorError, safe_open

from k3_tail.checkpoint import Checkpoint

NAME = "model.layers.1.block_sparse_moe.routed_expert_norm.weight"
OTHER = "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight"


def entry(shape, offsets, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def raw_safetensors(path, header, data):
    """A file in safetensors' layout written byte by byte: the 8-byte little-endian length of ``header``
    (a dict, as JSON, or bytes as they are), the header, then ``data``."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


# (header, data): each a file safetensors refuses.
MALFORMED = {
    "negative-start": ({NAME: entry([2], [-8, 0])}, b""),
    "negative-end": ({NAME: entry([0], [0, -4])}, b""),
    "overlapping": ({NAME: entry([2], [0, 8]), OTHER: entry([2], [4, 12])}, bytes(12)),
    "shifted-by-4": ({NAME: entry([2], [4, 12])}, bytes(12)),
    "gap": ({NAME: entry([1], [0, 4]), OTHER: entry([1], [8, 12])}, bytes(12)),
    "end-before-start": ({NAME: entry([0], [0, 0]), OTHER: entry([1], [4, 0])}, bytes(4)),
    "float-dim": ({NAME: entry([2.0], [0, 8])}, bytes(8)),
    "string-dim": ({NAME: entry(["2"], [0, 8])}, bytes(8)),
    "bool-dim": ({NAME: entry([True, 2], [0, 8])}, bytes(8)),
    "negative-dim": ({NAME: entry([-2, -1], [0, 8])}, bytes(8)),
    "float-offsets": ({NAME: entry([2], [0.0, 8.0])}, bytes(8)),
    "string-offsets": ({NAME: entry([2], ["0", "8"])}, bytes(8)),
    "bool-offsets": ({NAME: entry([1], [False, True])}, bytes(1)),
    "three-offsets": ({NAME: entry([2], [0, 8, 8])}, bytes(8)),
    "bytes-not-the-shapes": ({NAME: entry([3], [0, 8])}, bytes(8)),
    "unknown-dtype": ({NAME: entry([2], [0, 8], dtype="F12")}, bytes(8)),
    "header-not-utf-8": (json.dumps({NAME: entry([2], [0, 8])}).encode().replace(b"routed", b"rout\xffd"), bytes(8)),
    "header-not-json": (b"{" + json.dumps(NAME).encode() + b": ", bytes(8)),
    "header-too-deep": (b"[" * 100_000 + b"]" * 100_000, b""),
    "header-5000-digits": (b'{"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1' + b"0" * 5000 + b"]}}", b""),
    "header-an-array": (b"[]", b""),
    "metadata-not-strings": ({"__metadata__": {"format": 1}, NAME: entry([2], [0, 8])}, bytes(8)),
    "truncated-data": ({NAME: entry([2], [0, 8])}, bytes(4)),
    "bytes-after-the-data": ({NAME: entry([2], [0, 8])}, bytes(12)),
    "header-longer-than-the-file": (b'{"a": ', b""),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_file_safetensors_refuses_is_a_value_error_naming_the_file_with_safetensors_reason(case, tmp_path):
    """safetensors' own reason stands: it names the tensor where one is at fault (the offsets' cases)."""
    path = raw_safetensors(tmp_path / "model.safetensors", *MALFORMED[case])
    if case == "header-longer-than-the-file":
        path.write_bytes(struct.pack("<Q", 1000) + MALFORMED[case][0])
    with pytest.raises(SafetensorError) as refused:
        safe_open(path, "numpy")
    with pytest.raises(ValueError, match=rf"^checkpoint: {re.escape(repr(str(path)))}: safetensors refuses the "
                                         rf"file \({re.escape(str(refused.value))}\)$"):
        Checkpoint(tmp_path)


# (header, data): files safetensors reads, each read as it reads them.
ACCEPTED = {
    "header-out-of-offset-order": ({OTHER: entry([1], [8, 12]), NAME: entry([2], [0, 8])}, bytes(range(12))),
    "metadata-and-an-extra-key": ({"__metadata__": {"format": "pt"}, NAME: {**entry([2], [0, 8]), "x": 1}},
                                  bytes(range(8))),
    "empty-tensor": ({NAME: entry([0, 3], [0, 0]), OTHER: entry([2], [0, 8])}, bytes(range(8))),
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_a_file_safetensors_accepts_reads_as_safetensors_reads_it(case, tmp_path):
    path = raw_safetensors(tmp_path / "model.safetensors", *ACCEPTED[case])
    checkpoint = Checkpoint(tmp_path)
    with safe_open(path, "numpy") as reference:
        assert sorted(checkpoint.names) == sorted(reference.keys())
        for name in reference.keys():
            np.testing.assert_array_equal(checkpoint.read(name), reference.get_tensor(name))
