"""What XLA made of a compiled tail: per-device cost, every collective, the overlap verdict, the GPU kernels.

The entry computation of a compiled module is scheduled, so its instruction order is the order the device runs
it in (one stream of compute; async collectives run beside it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

import jax

from k3_tail._checks import check_path
from k3_tail.ops.codecs import CODECS
from k3_tail.ops.scopes import PREFIX as SCOPE_PREFIX, SCOPES
from k3_tail.tiers.record import RING_WIRE_FACTORS
from k3_tail.units import format_bytes, format_flops
from k3_tail.xla.hlo_text import (
    ArrayShape,
    Instruction,
    Module,
    computation_flops,
    dot_flops,
    exact_gemm_names,
    kernel_grid,
    kernel_warps,
    parse_module,
    replica_group_size,
)
from k3_tail.xla.launches import read_launches

_COLLECTIVE_KINDS = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
    "collective-broadcast",
)
SCOPE_NAMES = tuple(scope.removeprefix(SCOPE_PREFIX) for scope in SCOPES)
# Instructions that name or regroup buffers without touching their data.
_NO_DATA = {
    "parameter", "constant", "bitcast", "get-tuple-element", "tuple", "partition-id", "replica-id", "after-all",
    "opt-barrier",
}


@dataclasses.dataclass(frozen=True)
class Gemm:
    """A top-level instruction that runs a GEMM: its name, per-device FLOPs, schedule position, and the
    arrays it reads as the program passes them (an FP8 kernel that the fusion converts shows as f8e4m3fn);
    for a Triton or Pallas kernel (one_kernel's) its launch grid (x, y, z) and the warps (wavefronts on AMD) of
    each of its programs, else None."""

    name: str
    flops: int
    position: int
    operands: tuple[ArrayShape, ...]
    scopes: tuple[str, ...] = ()
    grid: tuple[int, int, int] | None = None
    warps: int | None = None

    @property
    def operand_types(self) -> tuple[str, ...]:
        """The element types of ``operands`` ("bf16", "f8e4m3fn", ...)."""
        return tuple(array.dtype for array in self.operands)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the compiled program (a start/done pair counts once, named by its start).

    Attributes:
      arrays: the full buffer: an all-gather's gathered result, a reduce-scatter's input, an
        all-reduce's reduced buffer, an all-to-all's send buffer; all of them for a combined one.
      wire_bytes: per rank on a ring, from ``bytes`` (docs/design.md, Conventions).
      between: the compute instructions the schedule puts between start and done (async only).
      carries_shared: whether an input derives from the shared partial.
      scopes: the tail's named scopes in its ``op_name``: several when XLA combined reduce-scatters of
        different scopes, none for an all-reduce that XLA's GPU combiner merged (it drops their metadata).
      quantization: the codec ("int8", "int6", "int4") of one of the two shots of a quantised sum
        (the all-to-all or the all-gather; its ``arrays`` are then the uint8 payload), else None.
    """

    name: str
    kind: str
    arrays: tuple[ArrayShape, ...]
    bytes: int
    group_size: int
    wire_bytes: int
    is_async: bool
    start: int
    done: int
    between: tuple[str, ...]
    between_gemms: tuple[str, ...]
    carries_shared: bool
    scopes: tuple[str, ...] = ()
    quantization: str | None = None

    @property
    def payload_dtypes(self) -> tuple[str, ...]:
        """The element types its arrays carry, in order ("bf16"; "u8" for a quantised payload)."""
        return tuple(dict.fromkeys(array.dtype for array in self.arrays))

    @property
    def form(self) -> str:
        """Its form in words: the kind, or for a shot of a quantised sum "int4-quantised all-to-all"."""
        return self.kind if self.quantization is None else f"{self.quantization}-quantised {self.kind}"


@dataclasses.dataclass(frozen=True)
class XlaReport:
    """Per-device figures and the collective schedule of one compiled program.

    Attributes:
      platform: the devices' ``.platform``; device_kind: their ``device_kind``.
      num_devices: the program's partitions.
      arguments: the program's arguments as each device holds them (its shard), in order.
      flops: from ``compiled.cost_analysis()`` where the backend gives it (CPU does), else the GEMMs'
        2*M*N*K from the HLO shapes (fusion bodies included).
      bytes_accessed: the same, else the operand and result bytes of every top-level instruction that
        touches data.
      cost_source: which of the two: "cost_analysis" or "hlo shapes (GEMM FLOPs only)".
      gemms: every top-level GEMM, in schedule order.
      collectives: every collective, in schedule order.
      shared_reduction: the first collective whose input derives from the shared partial (argument
        ``shared_argument`` of :func:`report`), or None. In a whole model's program, where the shared
        partial is no argument, :meth:`in_scope` finds the tail's parts by their named scopes.
      gpu_kernels: the GPU kernels the program launches, by the HLO instruction each runs, in order:
        fusions, Triton and Pallas kernels and library GEMMs, not its collectives, memcpys (the copies
        of jit parameters and contiguous slices) or memsets (:mod:`k3_tail.xla.launches`); None
        where it is not known (no dump given, or a CPU program).
    """

    platform: str
    device_kind: str
    num_devices: int
    arguments: tuple[ArrayShape, ...]
    flops: float
    bytes_accessed: float
    cost_source: str
    gemms: tuple[Gemm, ...]
    collectives: tuple[Collective, ...]
    shared_reduction: Collective | None
    gpu_kernels: tuple[str, ...] | None = None

    @property
    def gpu_kernel_count(self) -> int | None:
        """The number of GPU kernels the program launches (``len(gpu_kernels)``), or None where not known."""
        return None if self.gpu_kernels is None else len(self.gpu_kernels)

    @property
    def gemm_flops(self) -> int:
        """Per-device FLOPs of all GEMMs, from the HLO shapes."""
        return sum(gemm.flops for gemm in self.gemms)

    @property
    def overlapped(self) -> bool | None:
        """Whether the shared reduction runs async with a GEMM inside it (never on CPU, whose collectives
        are synchronous); None without one."""
        if self.shared_reduction is None:
            return None
        return self.shared_reduction.is_async and bool(self.shared_reduction.between_gemms)

    def in_scope(self, scope: str) -> tuple[Collective, ...]:
        """The collectives that carry the tail's named scope ``scope`` ("latent_reduction",
        "shared_reduction", "packed_reduction", "output_gather"), in schedule order."""
        if scope not in SCOPE_NAMES:
            raise ValueError(f"scope: expected one of {SCOPE_NAMES}, got {scope!r}")
        return tuple(collective for collective in self.collectives if scope in collective.scopes)

    def of_kind(self, kind: str) -> tuple[Collective, ...]:
        """The collectives of one kind ("all-reduce", "reduce-scatter", "all-gather", ...)."""
        return tuple(collective for collective in self.collectives if collective.kind == kind)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable), with ``gemm_flops`` and ``overlapped`` included."""
        return {**dataclasses.asdict(self), "gemm_flops": self.gemm_flops, "overlapped": self.overlapped,
                "gpu_kernel_count": self.gpu_kernel_count}

    def format(self) -> str:
        """The report as readable text."""
        lines = [
            f"compiled for: {self.platform} ({self.device_kind}), {self.num_devices} devices",
            f"per device: {format_flops(self.flops)}, {format_bytes(self.bytes_accessed)} accessed "
            f"({self.cost_source}); GEMMs {format_flops(self.gemm_flops)}",
            f"arguments per device: {_arrays_text(self.arguments)}",
            "GEMMs:",
            *(f"  [{gemm.position:3d}] {gemm.name}: {format_flops(gemm.flops)}, reads {_arrays_text(gemm.operands)}"
              for gemm in self.gemms),
            "collectives:",
        ]
        for collective in self.collectives:
            timing = f"sync [{collective.start}]"
            if collective.is_async:
                timing = f"async [{collective.start}..{collective.done}]"
            shared = "  <- shared reduction" if collective is self.shared_reduction else ""
            scopes = f" ({', '.join(collective.scopes)})" if collective.scopes else ""
            lines.append(
                f"  {collective.form} {' + '.join(map(str, collective.arrays))}{scopes}: "
                f"{format_bytes(collective.bytes)}, group {collective.group_size}, "
                f"wire {format_bytes(collective.wire_bytes)}/rank, {timing}{shared}"
            )
            if collective.between:
                lines.append(f"      scheduled inside: {', '.join(collective.between)}")
        lines.append(f"overlapped: {self.overlapped}")
        if self.gpu_kernels is not None:
            lines.append(f"GPU kernels besides collectives and copies: {len(self.gpu_kernels)} "
                         f"({', '.join(self.gpu_kernels)})")
        return "\n".join(lines)


def report(compiled: jax.stages.Compiled, *, shared_argument: int | None = 1,
           dump_dir: str | os.PathLike | None = None) -> XlaReport:
    """The :class:`XlaReport` of a compiled tail.

    Args:
      compiled: a ``jax.stages.Compiled`` program.
      shared_argument: the flat index of the shared partial among the program's arguments (1 for
        :func:`k3_tail.compile_tail`'s programs and for a jitted ``tail_forward(routed, shared, ...)``);
        None when there is none, which leaves ``shared_reduction`` and ``overlapped`` None.
      dump_dir: the directory XLA dumped this compile into (``xla_dump_to``), for ``gpu_kernels``; None leaves
        them None. Ignored for a CPU program.

    Returns:
      The report, per device.

    Raises:
      ValueError: naming ``compiled`` when it is no compiled program (a ``jax.stages.Lowered`` one needs
        ``.compile()`` first), ``shared_argument`` when it is not an index or None, or ``dump_dir`` when it
        holds no dump of this program's compile, or several.
    """
    if not isinstance(compiled, jax.stages.Compiled):
        raise ValueError(f"compiled: expected a jax.stages.Compiled program (k3_tail.compile_tail's, or "
                         f"jax.jit(f).lower(...).compile()), got {type(compiled).__name__}")
    if not isinstance(shared_argument, (int, type(None))) or isinstance(shared_argument, bool):
        raise ValueError(f"shared_argument: expected an argument index or None, got {shared_argument!r}")
    if dump_dir is not None:
        dump_dir = check_path("dump_dir", dump_dir, expected="the directory XLA dumped the compile into")
    module = parse_module(compiled.as_text())
    schedule = module.entry.instructions
    symbols = module.entry.by_name()
    device = _first_device(compiled)
    num_devices = module.num_partitions

    gemms = []
    exact = exact_gemm_names(module)
    for position, instruction in enumerate(schedule):
        flops = dot_flops(instruction, symbols, exact) + sum(
            computation_flops(module, name, exact) for name in instruction.called
        )
        if flops and _collective_kind(module, instruction) is None:
            operands = tuple(array for operand in instruction.operands for array in symbols[operand].arrays)
            gemms.append(Gemm(instruction.name, flops, position, operands, _scopes(instruction),
                              kernel_grid(instruction), kernel_warps(instruction)))
    gemm_names = {gemm.name for gemm in gemms}

    derives_from_shared = functools.partial(_derives_from, symbols=symbols, argument=shared_argument, memo={})
    collectives = tuple(
        _collective(module, symbols, position, num_devices, gemm_names, derives_from_shared)
        for position, instruction in enumerate(schedule)
        if _collective_kind(module, instruction) and not instruction.opcode.endswith("-done")
    )
    shared = next((c for c in collectives if c.carries_shared), None) if shared_argument is not None else None

    flops, bytes_accessed, source = _cost(compiled, schedule, symbols, sum(gemm.flops for gemm in gemms))
    gpu_kernels = None
    if dump_dir is not None and device is not None and device.platform != "cpu":
        gpu_kernels = tuple(launch.name for launch in read_launches(dump_dir, module.name) if launch.is_kernel)
    return XlaReport(
        platform=device.platform if device else "unknown",
        device_kind=getattr(device, "device_kind", "unknown"),
        num_devices=num_devices,
        arguments=tuple(
            array for instruction in _parameters(schedule) for array in instruction.arrays
        ),
        flops=flops,
        bytes_accessed=bytes_accessed,
        cost_source=source,
        gemms=tuple(gemms),
        collectives=collectives,
        shared_reduction=shared,
        gpu_kernels=gpu_kernels,
    )


def _collective_kind(module: Module, instruction: Instruction) -> str | None:
    """The collective an instruction performs (sync op, ``<kind>-start/-done`` or ``async-start``)."""
    opcode = instruction.opcode
    for suffix in ("-start", "-done"):
        if opcode.endswith(suffix):
            opcode = opcode[: -len(suffix)]
    if opcode == "async" and instruction.called:
        wrapped = module.computations.get(instruction.called[0])
        root = next((i for i in wrapped.instructions if i.is_root), None) if wrapped else None
        opcode = root.opcode if root else opcode
    return opcode if opcode in _COLLECTIVE_KINDS else None


def _collective(module, symbols, position, num_devices, gemm_names, derives_from_shared) -> Collective:
    schedule = module.entry.instructions
    instruction = schedule[position]
    kind = _collective_kind(module, instruction)
    is_async = instruction.opcode.endswith("-start")
    done = position
    if is_async:
        done = next(
            (index for index in range(position + 1, len(schedule))
             if schedule[index].opcode.endswith("-done") and schedule[index].operands[:1] == (instruction.name,)),
            position,
        )
    inputs = tuple(array for operand in instruction.operands for array in symbols[operand].arrays)
    if kind == "all-gather":
        # The gathered results, one per input: an all-gather-start's result is (inputs, outputs), and a
        # combined all-gather (XLA merges independent ones) has several of each.
        arrays = (schedule[done].arrays if is_async else instruction.arrays)[-len(inputs):]
    else:
        arrays = inputs
    size = sum(array.bytes for array in arrays)
    group = replica_group_size(instruction, num_devices)
    factor = RING_WIRE_FACTORS[kind](group) if kind in RING_WIRE_FACTORS else 1.0
    between = tuple(
        op.name for op in schedule[position + 1:done]
        if op.opcode not in _NO_DATA and _collective_kind(module, op) is None
    )
    return Collective(
        name=instruction.name,
        kind=kind,
        arrays=tuple(arrays),
        bytes=size,
        group_size=group,
        wire_bytes=int(round(factor * size)),
        is_async=is_async,
        start=position,
        done=done,
        between=between,
        between_gemms=tuple(name for name in between if name in gemm_names),
        carries_shared=any(derives_from_shared(operand) for operand in instruction.operands),
        scopes=_scopes(instruction),
        quantization=_quantization(instruction),
    )


def _quantization(instruction: Instruction) -> str | None:
    """The codec of a quantised sum whose collective ``instruction`` is (its named scope), or None."""
    found = re.search(r"quantized_(\w+?)(?:/|$)", instruction.op_name)
    return found.group(1) if found and found.group(1) in CODECS else None


def _scopes(instruction: Instruction) -> tuple[str, ...]:
    """The tail's scope names in ``instruction``'s op_name, in the order they appear: one, or several
    for a collective XLA combined ("k3_tail/(latent_reduction/...:shared_reduction/...)")."""
    op_name = instruction.op_name
    start = op_name.find(SCOPE_PREFIX)
    if start < 0:
        return ()
    found = re.findall(r"[\w.]+", op_name[start + len(SCOPE_PREFIX):])
    return tuple(dict.fromkeys(name for name in found if name in SCOPE_NAMES))


def _derives_from(name: str, *, symbols: dict[str, Instruction], argument: int | None, memo: dict[str, bool]) -> bool:
    """Whether the value ``name`` is computed from entry parameter ``argument``, following only the
    element a get-tuple-element takes (:func:`_followed_operands`)."""
    if argument is None or name not in symbols:
        return False
    if name not in memo:
        memo[name] = False  # cycles cannot occur in HLO; this only guards the recursion
        instruction = symbols[name]
        if instruction.opcode == "parameter":
            memo[name] = instruction.operand_text.strip() == str(argument)
        else:
            memo[name] = any(
                _derives_from(operand, symbols=symbols, argument=argument, memo=memo)
                for operand in _followed_operands(instruction, symbols)
            )
    return memo[name]


def _followed_operands(instruction: Instruction, symbols: dict[str, Instruction]) -> tuple[str, ...]:
    """The operands a value derives from; of a ``tuple`` (or an optimization barrier over one) only the element
    a get-tuple-element takes, so a barrier tying the shared partial to the latent does not make the latent shared."""
    if instruction.opcode != "get-tuple-element" or not instruction.operands:
        return instruction.operands
    source = symbols.get(instruction.operands[0])
    if source is not None and source.opcode == "opt-barrier" and source.operands:
        source = symbols.get(source.operands[0])
    index = int(instruction.attribute("index") or -1)
    if source is not None and source.opcode == "tuple" and 0 <= index < len(source.operands):
        return (source.operands[index],)
    return instruction.operands


def _parameters(schedule: tuple[Instruction, ...]) -> list[Instruction]:
    """The entry computation's parameters, in argument order."""
    parameters = [instruction for instruction in schedule if instruction.opcode == "parameter"]
    return sorted(parameters, key=lambda instruction: int(instruction.operand_text.strip()))


def _arrays_text(arrays: tuple[ArrayShape, ...]) -> str:
    """``bf16[16,3584] (112 KiB), f8e4m3fn[3584,7168] (24.5 MiB)``."""
    return ", ".join(f"{array} ({format_bytes(array.bytes)})" for array in arrays) or "none"


def _first_device(compiled: jax.stages.Compiled):
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
    for sharding in shardings:
        for device in sharding.device_set:
            return device
    return None


def _cost(compiled, schedule, symbols, gemm_flops) -> tuple[float, float, str]:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    if analysis and "flops" in analysis:
        return float(analysis["flops"]), float(analysis.get("bytes accessed", 0.0)), "cost_analysis"
    touched = 0
    for instruction in schedule:
        if instruction.opcode in _NO_DATA or instruction.opcode.endswith("-done"):
            continue
        touched += sum(array.bytes for array in instruction.arrays)
        touched += sum(array.bytes for operand in instruction.operands for array in symbols[operand].arrays)
    return float(gemm_flops), float(touched), "hlo shapes (GEMM FLOPs only)"
