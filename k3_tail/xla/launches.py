"""What a compiled GPU program launches: XLA's thunks, read from the dump it writes with ``xla_dump_to``
(deviceless compiles write it too). The compiled HLO does not say which fusions become kernels (a contiguous
slice may be a memcpy, a broadcast of zero a memset); ``<module>.thunk_metadata.txt`` does
(:func:`read_launches`), and the thunk sequence nests command buffers' thunks (:func:`read_thunk_sequence`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

# Thunk kinds that launch GPU kernels: XLA's own kernels (fusions, Triton, Pallas), library GEMMs,
# cuDNN / MIOpen calls. Everything else is a collective, a copy or memset, or bookkeeping.
KERNEL_KINDS = ("kKernel", "kCustomKernel", "kGemm", "kCublasLtMatmul", "kCuDnn", "kConvolution")
METADATA_SUFFIX = ".thunk_metadata.txt"
_ENTRY = re.compile(r'thunk_metadata\s*\{\s*thunk_info\s*\{(?P<info>[^}]*)\}\s*thunk_kind:\s*"(?P<kind>\w+)"')
_ANNOTATION = re.compile(r'profile_annotation:\s*"(?P<name>[^"]*)"')


@dataclasses.dataclass(frozen=True)
class Launch:
    """One thunk of a compiled GPU program: the HLO instruction it runs (its profile annotation) and its
    kind ("kCustomKernel", "kCopy", "kAllReduce", ...)."""

    name: str
    kind: str

    @property
    def is_kernel(self) -> bool:
        """Whether it launches a GPU kernel (:data:`KERNEL_KINDS`)."""
        return self.kind in KERNEL_KINDS


def read_launches(dump_dir: str | os.PathLike, module_name: str) -> tuple[Launch, ...]:
    """The thunks of the compiled module ``module_name`` (its ``HloModule`` name, "jit_call") whose dump
    XLA wrote into ``dump_dir`` (compiler option ``xla_dump_to``), in execution order.

    Raises:
      ValueError: naming ``dump_dir`` when it holds no thunk metadata of that module, or that of
        several compiles of it (use a fresh directory per compile).
    """
    directory = Path(dump_dir)
    found = sorted(directory.glob(f"*.{module_name}{METADATA_SUFFIX}")) if directory.is_dir() else []
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} compiles' "
        raise ValueError(f"dump_dir: expected XLA's dump of one compile of {module_name!r} (compiler option "
                         f"xla_dump_to) in {str(directory)!r}, found {what}thunk metadata ({METADATA_SUFFIX})")
    text = found[0].read_text()
    launches = []
    for entry in _ENTRY.finditer(text):
        annotation = _ANNOTATION.search(entry.group("info"))
        launches.append(Launch(annotation.group("name") if annotation else "", entry.group("kind")))
    return tuple(launches)


# The thunk sequence XLA runs, as its dump prints it: after its thunk passes (which wrap runs of thunks in command
# buffers: jax 0.10.2 and 0.12) where it wrote that file, else as emitted (a compile whose passes changed nothing).
SEQUENCE_SUFFIXES = (".thunk_sequence_after_thunk_passes.txt", ".thunk_sequence.txt")
# Thunk kinds of collectives: the collective library's (all-reduce, reduce-scatter, all-gather, all-to-all,
# collective-permute, broadcast, send and receive, their start/done forms and groups) and XLA's own collective
# kernels. An async start/done pair around one of them is a collective too (SequencedThunk.is_collective).
_COLLECTIVE_KIND = re.compile(r"k(?:Nccl)?(?:AllReduce|ReduceScatter|AllGather|RaggedAllToAll|AllToAll|"
                              r"CollectivePermute|CollectiveBroadcast|CollectiveKernel|Send|Recv|Group)\w*")
_SEQUENCED = re.compile(r"^(?P<indent> *)\d+:\s+(?P<kind>k\w+)\s*(?P<text>.*)$")
_ASYNC_ID = re.compile(r"\basync_id=(\d+)")


@dataclasses.dataclass(frozen=True)
class SequencedThunk:
    """One thunk of a compiled GPU program's thunk sequence: its kind, the text its line prints after the kind
    (edges, the kernel and its grid, an async id), whether it is a collective, and the kinds of the thunks it lies
    inside, outermost first (a command buffer, a loop, the async start that runs it)."""

    kind: str
    text: str
    is_collective: bool
    enclosing: tuple[str, ...]

    @property
    def in_command_buffer(self) -> bool:
        """Whether a command buffer (a CUDA/HIP graph) runs it."""
        return "kCommandBuffer" in self.enclosing


def read_thunk_sequence(dump_dir: str | os.PathLike, module_name: str) -> tuple[SequencedThunk, ...]:
    """Every thunk of the compiled module ``module_name``, nested ones included, in the order XLA's dump in
    ``dump_dir`` prints them.

    Raises:
      ValueError: naming ``dump_dir`` when it holds no thunk sequence of that module, or that of several compiles.
    """
    directory = Path(dump_dir)
    for suffix in SEQUENCE_SUFFIXES:
        found = sorted(directory.glob(f"*.{module_name}{suffix}")) if directory.is_dir() else []
        if found:
            break
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} compiles' "
        raise ValueError(f"dump_dir: expected XLA's dump of one compile of {module_name!r} (compiler option "
                         f"xla_dump_to) in {str(directory)!r}, found {what}thunk sequence ({SEQUENCE_SUFFIXES[-1]})")
    lines = [match for match in map(_SEQUENCED.match, found[0].read_text().splitlines()) if match]
    parents, stack = [], []  # stack: (indent, index) of the thunks enclosing the current line
    for index, line in enumerate(lines):
        indent = len(line.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parents.append(stack[-1][1] if stack else None)
        stack.append((indent, index))
    kinds = [line.group("kind") for line in lines]
    collective = [bool(_COLLECTIVE_KIND.fullmatch(kind)) for kind in kinds]
    # An async start whose child is a collective, and the done that waits for it.
    async_ids = {_ASYNC_ID.search(lines[parent].group("text")).group(1)
                 for index, parent in enumerate(parents)
                 if collective[index] and parent is not None and kinds[parent] == "kAsyncStart"
                 and _ASYNC_ID.search(lines[parent].group("text"))}
    for index, line in enumerate(lines):
        async_id = _ASYNC_ID.search(line.group("text"))
        if kinds[index] in ("kAsyncStart", "kAsyncDone") and async_id and async_id.group(1) in async_ids:
            collective[index] = True

    def enclosing(index):
        chain, parent = [], parents[index]
        while parent is not None:
            chain.append(kinds[parent])
            parent = parents[parent]
        return tuple(reversed(chain))

    return tuple(SequencedThunk(kinds[index], line.group("text").strip(), collective[index], enclosing(index))
                 for index, line in enumerate(lines))


def collectives_in_command_buffers(dump_dir: str | os.PathLike, module_name: str) -> tuple[SequencedThunk, ...]:
    """The collective thunks of ``module_name`` (:func:`read_thunk_sequence`) that a command buffer runs: none in
    any ROCm program the library compiles (a collective captured in a HIP graph is re-traced at every record)."""
    return tuple(thunk for thunk in read_thunk_sequence(dump_dir, module_name)
                 if thunk.is_collective and thunk.in_command_buffer)
