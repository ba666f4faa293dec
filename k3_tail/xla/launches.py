"""What a compiled GPU program launches: XLA's thunks, read from the dump it writes with ``xla_dump_to``.

A GPU executable runs a sequence of thunks: kernels, library GEMMs, collectives, memcpys, memsets, the
partition id, command buffers (CUDA/HIP graphs) holding some of them. The compiled HLO does not say
which of its fusions become kernels (XLA emits a contiguous slice as a memcpy, a broadcast of zero may
be a memset), but XLA's dump does: ``<module>.thunk_metadata.txt`` names every thunk by the HLO
instruction it came from and its kind, command buffers' contents included. Deviceless compiles write
it too. :func:`read_launches` reads it; :mod:`k3_tail.xla.report` counts the kernels.
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
