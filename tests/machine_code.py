"""The machine code of a compiled GPU program's kernels, read from its executable: AMDGCN or SASS.

A GPU executable serialises (``Compiled``'s XLA executable, ``serialize()``) to XLA's GPU executable
proto, compressed with snappy, which holds each module's code object as an ELF image: an AMDGPU code
object (hsaco) on ROCm, a cubin on CUDA. Deviceless compiles (``k3_tail.topology_mesh``) hold them too.
:func:`kernel_code` finds a kernel's image by its symbol and disassembles it:

- AMDGPU: an ``llvm-objdump`` that knows the image's processor (gfx950 needs LLVM 20 or newer: Debian's
  ``apt-get install llvm-22``; the ``llvm`` package, 14, knows neither gfx942 nor gfx950 well);
- NVIDIA: ``nvdisasm`` (PyPI's ``nvidia-cuda-nvdisasm``, in the ``[dev]`` extra).

The tests read the split-K kernel's memory ordering from it (k3_tail/ops/fused_projection.py,
"Memory ordering"). Nothing here runs at import or in a call of the tail.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

# Installs that bring each disassembler, for the message of DisassemblerUnavailable.
LLVM_OBJDUMP_INSTALL = "apt-get update && apt-get install -y llvm-22"
NVDISASM_INSTALL = "pip install nvidia-cuda-nvdisasm (in k3_tail's [dev] extra)"
OBJDUMP_VARIABLE = "K3_TAIL_LLVM_OBJDUMP"
# ELF machine numbers and the AMDGPU processor field of e_flags (LLVM's EF_AMDGPU_MACH_*).
_EM_AMDGPU, _EM_CUDA = 224, 190
_AMDGPU_MACH_MASK = 0xFF
_AMDGPU_PROCESSORS = {0x40: "gfx940", 0x4B: "gfx941", 0x4C: "gfx942", 0x4F: "gfx950"}
_ELF_MAGIC = b"\x7fELF"
_SHT_NOBITS = 8  # a section that takes no bytes of the file (.bss)
_SMALLEST_STREAM = 1024  # bytes: the executable proto's snappy stream is tens of KB


class DisassemblerUnavailable(RuntimeError):
    """No disassembler for a code object's architecture is installed; the message says what installs one."""


@dataclasses.dataclass(frozen=True)
class KernelCode:
    """One kernel's machine code: its symbol, the processor ("gfx942", "sm_90a"...) and its instructions in
    address order, each as the disassembler prints it without address and encoding ("global_atomic_add v1,
    v1, v2, s[6:7] sc0", "@P2 ATOMG.E.ADD.STRONG.GPU PT, R17, desc[UR6][R16.64], R19")."""

    name: str
    processor: str
    instructions: tuple[str, ...]


def code_objects(compiled) -> tuple[bytes, ...]:
    """The ELF images (code objects) inside ``compiled``'s GPU executable (a ``jax.stages.Compiled``)."""
    return tuple(_images_in_streams(bytes(compiled.runtime_executable().serialize())))


def kernel_code(compiled, kernel_name: str) -> KernelCode:
    """The machine code of the kernel whose symbol is ``kernel_name`` in ``compiled``'s executable.

    Raises:
      ValueError: naming ``kernel_name`` when no code object holds it.
      DisassemblerUnavailable: when no disassembler for its architecture is installed.
    """
    symbol = kernel_name.encode()
    for image in code_objects(compiled):
        if symbol in image:
            return _disassemble(image, kernel_name)
    raise ValueError(f"kernel_name: expected a kernel of the compiled program, found no code object holding "
                     f"{kernel_name!r}")


def disassembly(image: bytes) -> tuple[str, str]:
    """(the processor, the whole disassembly text) of a code object ``image`` (:func:`code_objects`): AMDGCN by
    ``llvm-objdump``, SASS by ``nvdisasm``.

    Raises:
      ValueError: for an ELF image of neither machine.
      DisassemblerUnavailable: when no disassembler for its architecture is installed.
    """
    machine, flags = struct.unpack_from("<H4xI", image, 18)[0], struct.unpack_from("<I", image, 48)[0]
    with tempfile.TemporaryDirectory(prefix="k3_tail_code_") as directory:
        path = Path(directory) / "kernel.elf"
        path.write_bytes(image)
        if machine == _EM_AMDGPU:
            processor = _AMDGPU_PROCESSORS.get(flags & _AMDGPU_MACH_MASK, f"amdgcn mach {flags & 0xFF:#x}")
            return processor, _objdump(path, processor)
        if machine == _EM_CUDA:
            return (f"sm_{(flags >> 8) & 0xFF}" if (flags >> 8) & 0xFF else "sm_?"), _run([nvdisasm(), str(path)])
    raise ValueError(f"image: expected an AMDGPU or CUDA code object, got one of ELF machine {machine}")


def _disassemble(image: bytes, kernel_name: str) -> KernelCode:
    processor, text = disassembly(image)
    if processor.startswith("sm_"):
        return KernelCode(kernel_name, processor, _function(text, kernel_name, _sass_instruction,
                                                            r"^\.text\.{name}:", r"^//-{5,}|^\s*\.section"))
    return KernelCode(kernel_name, processor, _function(text, kernel_name, _amdgcn_instruction,
                                                        r"<{name}>:$", r"^[0-9a-f]+ <.*>:$"))


def _objdump(path: Path, processor: str) -> str:
    """The disassembly of the AMDGPU code object at ``path`` by the first ``llvm-objdump`` that knows
    ``processor``: ``$K3_TAIL_LLVM_OBJDUMP``, the newest versioned one on PATH (``llvm-objdump-22``, ...),
    ``llvm-objdump``. An LLVM that does not know it says "not a recognized processor" and prints no code."""
    candidates = [os.environ[OBJDUMP_VARIABLE]] if os.environ.get(OBJDUMP_VARIABLE) else []
    candidates += [f"llvm-objdump-{version}" for version in range(30, 17, -1)] + ["llvm-objdump"]
    for candidate in filter(None, map(shutil.which, candidates)):
        result = subprocess.run([candidate, "-d", "--triple=amdgcn-amd-amdhsa", f"--mcpu={processor}", str(path)],
                                capture_output=True, text=True, check=False)
        if result.returncode == 0 and "not a recognized processor" not in result.stderr:
            return result.stdout
    raise DisassemblerUnavailable(f"no llvm-objdump that knows {processor} (${OBJDUMP_VARIABLE}, llvm-objdump-N "
                                  f"on PATH): {LLVM_OBJDUMP_INSTALL}")


def nvdisasm() -> str:
    """``nvdisasm``: on PATH, else the one PyPI's nvidia-cuda-nvdisasm installs beside the interpreter."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("*/bin/nvdisasm"), reverse=True):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    raise DisassemblerUnavailable(f"no nvdisasm (on PATH or from PyPI's nvidia-cuda-nvdisasm): {NVDISASM_INSTALL}")


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({result.returncode}): {result.stderr.strip()[:500]}")
    return result.stdout


def _function(text: str, name: str, instruction, start: str, end: str) -> tuple[str, ...]:
    """The instructions of function ``name`` in a disassembly ``text``: from the line matching ``start`` (with
    the name in place of {name}) to the next matching ``end``, each line parsed by ``instruction`` (None for a
    line that holds none: labels, directives)."""
    lines = text.splitlines()
    begin = re.compile(start.format(name=re.escape(name)))
    first = next((i for i, line in enumerate(lines) if begin.search(line)), None)
    if first is None:
        raise ValueError(f"kernel_name: {name!r} is in the code object but not among its disassembled functions")
    body = []
    for line in lines[first + 1:]:
        if re.search(end, line):
            break
        parsed = instruction(line)
        if parsed:
            body.append(parsed)
    return tuple(body)


def _amdgcn_instruction(line: str) -> str | None:
    # "\tglobal_store_dword v0, v1, s[6:7]        // 000000002230: DC708000 00060100"
    if not line.startswith("\t"):
        return None
    return line.split("//", 1)[0].strip() or None


def _sass_instruction(line: str) -> str | None:
    # "        /*1ab0*/               @P2 ATOMG.E.ADD.STRONG.GPU PT, R17, desc[UR6][R16.64], R19 ;"
    found = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
    return found.group(1) if found else None


def _elf_images(payload: bytes) -> list[bytes]:
    """The ELF64 images in ``payload``, each cut at its size: the end of its last header table or section."""
    images = []
    for found in re.finditer(re.escape(_ELF_MAGIC), payload):
        start = found.start()
        if len(payload) - start < 64 or payload[start + 4] != 2:  # ELFCLASS64
            continue
        program_headers, section_headers = struct.unpack_from("<QQ", payload, start + 32)
        program_entry, program_count, section_entry, section_count = struct.unpack_from("<HHHH", payload,
                                                                                          start + 54)
        end = max(program_headers + program_entry * program_count, section_headers + section_entry * section_count)
        for index in range(section_count):
            header = start + section_headers + index * section_entry
            if header + 40 > len(payload):
                break
            kind, = struct.unpack_from("<I", payload, header + 4)
            offset, size = struct.unpack_from("<QQ", payload, header + 24)
            if kind != _SHT_NOBITS:
                end = max(end, offset + size)
        if section_headers and start + end <= len(payload):
            images.append(payload[start:start + end])
    return images


def _images_in_streams(blob: bytes) -> list[bytes]:
    """The ELF images (:func:`_elf_images`) in the raw snappy streams of ``blob`` (an executable's serialisation:
    headers, then the compressed proto), decompressed. Neither a stream's start nor its end is recorded where a
    reader could find it, and a library decoder (cramjam's, python-snappy's) takes exactly one whole stream: so
    every offset is tried with this small decoder, which stops where a stream's stated length is reached (a varint
    first, then elements).

    Bytes that are not a stream can still decode as one now and then (seen: 1 in 12 compiles of one program for
    gfx950, whose headers differ by a temporary directory's name), and such a stream can run into the real one's
    first bytes: so only a stream that holds whole ELF images is stepped over; after any other the scan goes on at
    the next offset."""
    images, offset = [], 0
    while offset < len(blob):
        decoded = _snappy_at(blob, offset)
        found = _elf_images(decoded[0]) if decoded is not None else []
        images += found
        offset = decoded[1] if found else offset + 1
    return images


def _snappy_at(blob: bytes, offset: int) -> tuple[bytes, int] | None:
    """(the stream decoded, its end) for a raw snappy stream at ``offset`` of at least _SMALLEST_STREAM bytes
    decoded, or None. Snappy's format: a varint length, then literal and copy elements (tags 0-3)."""
    length, i = _varint(blob, offset)
    if length is None or not _SMALLEST_STREAM <= length <= 64 * (len(blob) - i):
        return None
    out = bytearray()
    try:
        while len(out) < length:
            tag = blob[i]
            i += 1
            kind = tag & 3
            if kind == 0:
                size = tag >> 2
                if size >= 60:
                    extra = size - 59
                    size = int.from_bytes(blob[i:i + extra], "little")
                    i += extra
                size += 1
                if i + size > len(blob):
                    return None
                out += blob[i:i + size]
                i += size
                continue
            if kind == 1:
                size, distance = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | blob[i]
                i += 1
            else:
                width = 2 if kind == 2 else 4
                size, distance = (tag >> 2) + 1, int.from_bytes(blob[i:i + width], "little")
                i += width
            if not 0 < distance <= len(out):
                return None
            for _ in range(size):  # copies may overlap their own output
                out.append(out[-distance])
    except IndexError:
        return None
    return (bytes(out), i) if len(out) == length else None


def _varint(blob: bytes, offset: int) -> tuple[int | None, int]:
    value = shift = 0
    for i in range(offset, min(offset + 5, len(blob))):
        value |= (blob[i] & 0x7F) << shift
        if blob[i] < 0x80:
            return value, i + 1
        shift += 7
    return None, offset
