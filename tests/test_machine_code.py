"""Code objects read out of a compiled executable's serialisation (tests/machine_code.py), on bytes made here:
the scan for its raw snappy streams finds the real stream even where other bytes decode as one and run into it
(seen once in 12 compiles of one gfx950 program, whose headers differ by a temporary directory's name)."""

import struct
import types

import machine_code


def elf_image() -> bytes:
    """A 128-byte ELF64 image: its 64-byte header, then one section header (64 bytes) for a section of 128 bytes."""
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<QQ", header, 32, 0, 64)          # no program headers; section headers at byte 64
    struct.pack_into("<HHHH", header, 54, 0, 0, 64, 1)  # one section header of 64 bytes
    section = bytearray(64)
    struct.pack_into("<I", section, 4, 1)               # PROGBITS
    struct.pack_into("<QQ", section, 24, 0, 128)        # bytes 0-128 of the image
    return bytes(header + section)


def literal_stream(payload: bytes) -> bytes:
    """``payload`` (at most 2^16 bytes, at least 61) as a raw snappy stream of one literal: its length as a varint,
    then the literal's tag with a 2-byte length."""
    length, varint = len(payload), bytearray()
    while True:
        varint.append((length & 0x7F) | (0x80 if length > 0x7F else 0))
        length >>= 7
        if not length:
            break
    return bytes(varint) + bytes([61 << 2]) + (len(payload) - 1).to_bytes(2, "little") + payload


def serialised(blob: bytes):
    """A stand-in for a ``jax.stages.Compiled`` whose executable serialises to ``blob``."""
    return types.SimpleNamespace(runtime_executable=lambda: types.SimpleNamespace(serialize=lambda: blob))


def test_the_image_in_a_stream_after_a_header_is_found_whole():
    image = elf_image()
    blob = b"header" * 100 + literal_stream(b"\0" * 2000 + image + b"\0" * 100)
    assert machine_code.code_objects(serialised(blob)) == (image,)


def test_bytes_that_decode_as_a_stream_running_into_the_real_one_do_not_hide_it():
    image = elf_image()
    real = literal_stream(b"\1" * 2000 + image + b"\1" * 100)
    # A false stream just before: its literal takes 50 bytes of its own and the real stream's first 1050.
    false = literal_stream(b"\2" * 50 + real[:1050])[:-1050]
    assert machine_code._snappy_at(false + real, 0) is not None  # it does decode, ending inside the real stream
    assert machine_code.code_objects(serialised(b"header" + false + real)) == (image,)
