"""A small reader of compiled HLO text: computations, instructions, shapes and GEMM FLOPs.

``compiled.as_text()`` is the one view of a compiled program that every backend and jax version
gives, including deviceless GPU compiles, so the XLA report reads it instead of private HLO
bindings. It understands what the report needs: the instruction list of each computation in
schedule order (the entry computation of a compiled module is scheduled), operand names, result
types (arrays and tuples), called computations, and the dimension numbers of dots and GEMM
custom calls. Both operand spellings (``%a`` and ``bf16[2]{0} %a``) and both replica-group
spellings (``{{0,1}}``, ``[1,2]<=[2]`` and ``mesh['tp'=2] {'tp'}``) are read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from k3_tail.ops.scopes import GEMM_FLOPS_KEY

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    """One array of a result type: its element type and dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return int(self.elements * _DTYPE_BYTES.get(self.dtype, 0))

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``name = type opcode(operands), attributes``."""

    name: str
    type_text: str
    opcode: str
    operands: tuple[str, ...]
    operand_text: str
    attributes: str
    is_root: bool

    @property
    def arrays(self) -> tuple[ArrayShape, ...]:
        """The arrays of the result type, flattened in order (a tuple type gives several)."""
        return array_shapes(self.type_text)

    @property
    def called(self) -> tuple[str, ...]:
        """Names of the computations this instruction calls (fusion bodies, reducers, loop bodies)."""
        names = []
        for match in _CALLED.finditer(self.attributes):
            names.extend(name.strip().lstrip("%") for name in match.group(1).strip("{}").split(",") if name.strip())
        return tuple(names)

    @property
    def op_name(self) -> str:
        """The ``op_name`` of its metadata (the JAX operation and named scopes it came from), or ""."""
        return _op_name(self)

    def attribute(self, key: str) -> str | None:
        """The raw text of ``key=...`` (braced values whole), or None."""
        match = re.search(rf"\b{re.escape(key)}=", self.attributes)
        if match is None:
            return None
        return _balanced_prefix(self.attributes[match.end():])


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]

    def by_name(self) -> dict[str, Instruction]:
        return {instruction.name: instruction for instruction in self.instructions}


@dataclasses.dataclass(frozen=True)
class Module:
    """A parsed HLO module; ``entry.instructions`` are in schedule order for a scheduled module."""

    header: str
    computations: dict[str, Computation]

    @property
    def entry(self) -> Computation:
        return next(computation for computation in self.computations.values() if computation.is_entry)

    @property
    def name(self) -> str:
        """The module's name ("jit_call"), as XLA names its dump files."""
        match = re.match(r"HloModule\s+([\w.\-]+)", self.header)
        return match.group(1) if match else ""

    @property
    def num_partitions(self) -> int:
        match = re.search(r"\bnum_partitions=(\d+)", self.header)
        return int(match.group(1)) if match else 1


def parse_module(text: str) -> Module:
    """Parse the text of one HLO module (``compiled.as_text()``); ValueError when it has no entry."""
    header = ""
    computations: dict[str, Computation] = {}
    current: tuple[str, bool, list[Instruction]] | None = None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            header = line
            continue
        if current is None:
            match = _HEADER.match(line)
            if match:
                current = (match.group(2), bool(match.group(1)), [])
            continue
        if line.strip() == "}":
            computations[current[0]] = Computation(current[0], current[1], tuple(current[2]))
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            current[2].append(instruction)
    if not any(computation.is_entry for computation in computations.values()):
        raise ValueError("hlo_text: expected HLO module text with an ENTRY computation")
    return Module(header, computations)


# Instructions that write no array of their own: views, tuples, constants, the program's inputs, and the control
# flow whose results are its bodies' (a loop's tuple carries the weights it reads).
_NOT_WRITTEN = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "while",
                          "conditional", "call"})
# The floating-point element types (a decoded copy of weights is one), and the 8-bit integer ones (packed codes).
FLOAT_DTYPES = frozenset({"f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "bf16", "f16", "f32", "f64"})
BYTE_DTYPES = frozenset({"u8", "s8"})


def largest_write(module: Module, dtypes: frozenset[str]) -> ArrayShape | None:
    """The largest array (by elements) of an element type in ``dtypes`` that an instruction of ``module`` writes:
    the results of its kernels and other instructions outside fusion bodies (in the entry, loop bodies and
    branches), the program's inputs and views of them left out. None when it writes none. A decoded copy of
    weights shows here among :data:`FLOAT_DTYPES`, a copy of packed codes among :data:`BYTE_DTYPES`."""
    fused = {name for computation in module.computations.values() for instruction in computation.instructions
             if instruction.opcode == "fusion" for name in instruction.called}
    written = [array for computation in module.computations.values() if computation.name not in fused
               for instruction in computation.instructions if instruction.opcode not in _NOT_WRITTEN
               for array in instruction.arrays if array.dtype in dtypes]
    return max(written, key=lambda array: array.elements, default=None)


def array_shapes(type_text: str) -> tuple[ArrayShape, ...]:
    """All arrays in a result type such as ``bf16[16,7168]{1,0}`` or ``(f32[5,64], f32[5,99])``."""
    return tuple(
        ArrayShape(dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text)
        if dtype in _DTYPE_BYTES
    )


def dot_flops(instruction: Instruction, symbols: dict[str, Instruction], exact: frozenset[str] = frozenset()) -> int:
    """The GEMM FLOPs one instruction performs: 2 * (output elements) * (contracted length) for a ``dot`` or
    GEMM custom call, 0 for others. ``symbols`` maps the computation's names to their instructions."""
    # XLA's split-K GEMMs carry the split as a batch dimension, so they still add up to 2*M*N*K. A matrix-vector
    # product that XLA rewrote into a multiply and a reduce (for a single token) keeps the dot_general op name:
    # its multiply counts one FLOP per output element and its reduce one per input element, only for op names
    # not in ``exact`` (:func:`exact_gemm_names`), so the reduce of a split-K GEMM does not count twice.
    declared = declared_gemm_flops(instruction)
    if declared is not None:
        return declared
    if instruction.opcode == "dot":
        contracting = _dims(instruction.attribute("lhs_contracting_dims"))
    elif is_gemm_custom_call(instruction):
        config = instruction.attribute("backend_config") or ""
        match = re.search(r'"lhs_contracting_dimensions"\s*:\s*(\[[^\]]*\])', config)
        contracting = tuple(int(d) for d in json.loads(match.group(1))) if match else None
    elif instruction.opcode in ("multiply", "reduce") and _is_decomposed_dot(instruction, exact):
        counted = instruction if instruction.opcode == "multiply" else symbols.get(instruction.operands[0])
        return math.prod(counted.arrays[0].dims) if counted is not None and counted.arrays else 0
    else:
        return 0
    lhs = symbols.get(instruction.operands[0]) if instruction.operands else None
    if lhs is None or not lhs.arrays or not instruction.arrays:
        return 0
    lhs_dims = lhs.arrays[0].dims
    if contracting is None:  # a GEMM custom call without dimension numbers contracts the last lhs dimension
        contracting = (len(lhs_dims) - 1,)
    return 2 * math.prod(instruction.arrays[0].dims) * math.prod(lhs_dims[d] for d in contracting)


def declared_gemm_flops(instruction: Instruction) -> int | None:
    """The GEMM FLOPs a kernel custom call states in its metadata (k3_tail's Pallas kernel,
    :data:`GEMM_FLOPS_KEY`), or None."""
    if instruction.opcode != "custom-call":
        return None
    # The metadata is JSON inside the HLO printer's string: {\22key\22: \22123\22} (\22 is a quote).
    match = re.search(re.escape(GEMM_FLOPS_KEY) + r'(?:\\22|[\s:"\\])*(\d+)', instruction.attributes)
    return int(match.group(1)) if match else None


def kernel_grid(instruction: Instruction) -> tuple[int, int, int] | None:
    """The launch grid (x, y, z) a Triton or Pallas custom call states in its backend config, or None."""
    if instruction.opcode != "custom-call":
        return None
    found = dict(re.findall(r"\bgrid_([xyz])\s*=\s*(\d+)", instruction.attributes))
    return (int(found["x"]), int(found["y"]), int(found["z"])) if len(found) == 3 else None


def kernel_warps(instruction: Instruction) -> int | None:
    """The warps (wavefronts on AMD) a program of a Triton or Pallas custom call runs, from its backend config,
    or None."""
    if instruction.opcode != "custom-call":
        return None
    found = re.search(r"\bnum_warps\s*=\s*(\d+)", instruction.attributes)
    return int(found.group(1)) if found else None


def is_gemm_custom_call(instruction: Instruction) -> bool:
    """A custom call into a GEMM library (cuBLAS, cuBLASLt, hipBLASLt, rocBLAS, oneDNN matmul)."""
    if instruction.opcode != "custom-call":
        return False
    target = (instruction.attribute("custom_call_target") or "").lower()
    return "gemm" in target or "matmul" in target


def exact_gemm_names(module: Module) -> frozenset[str]:
    """The op names (metadata) of the module's dots and GEMM custom calls."""
    return frozenset(
        _op_name(instruction)
        for computation in module.computations.values()
        for instruction in computation.instructions
        if instruction.opcode == "dot" or is_gemm_custom_call(instruction)
    )


def computation_flops(module: Module, name: str, exact: frozenset[str]) -> int:
    """GEMM FLOPs of a called computation and of everything it calls in turn (see :func:`dot_flops`)."""
    computation = module.computations.get(name)
    if computation is None:
        return 0
    symbols = computation.by_name()
    return sum(
        dot_flops(instruction, symbols, exact)
        + sum(computation_flops(module, called, exact) for called in instruction.called)
        for instruction in computation.instructions
    )


def replica_group_size(instruction: Instruction, default: int) -> int:
    """Devices per replica group of a collective; ``default`` when the groups are empty (all devices)."""
    groups = instruction.attribute("replica_groups")
    if groups is None:
        return default
    mesh = re.match(r"mesh\[(.*?)\]\s*\{(.*?)\}", groups)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[axis]) for axis in re.findall(r"'([^']+)'", mesh.group(2)))
    iota = re.search(r"\breplica_groups=\[(\d+),(\d+)\]<=", instruction.attributes)
    if iota:
        return int(iota.group(2))
    first = re.match(r"\{\{([^}]*)\}", groups)
    if first:
        return len(first.group(1).split(","))
    return default


def _parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    operand_text = _balanced_prefix(line[match.end() - 1:])
    rest = line[match.end() - 1 + len(operand_text):].lstrip(", ")
    operands = tuple(re.findall(r"%([\w.\-]+)", operand_text))
    return Instruction(
        match.group(2), match.group(3), match.group(4), operands, operand_text[1:-1], rest, bool(match.group(1))
    )


def _balanced_prefix(text: str) -> str:
    """The leading bracketed group of ``text`` (or the text up to the next top-level comma)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth = 0
    in_string = False
    for index, char in enumerate(text):
        if char == '"' and (index == 0 or text[index - 1] != "\\"):
            in_string = not in_string
        if in_string:
            continue
        if char in pairs:
            depth += 1
        elif char in pairs.values():
            depth -= 1
            if depth == 0 and text[0] in pairs:
                return text[: index + 1]
        elif char == "," and depth == 0:
            return text[:index]
    return text


def _is_decomposed_dot(instruction: Instruction, exact: frozenset[str]) -> bool:
    name = _op_name(instruction)
    return name.endswith("dot_general") and name not in exact


def _op_name(instruction: Instruction) -> str:
    match = re.search(r'\bop_name="([^"]*)"', instruction.attribute("metadata") or "")
    return match.group(1) if match else ""


def _dims(text: str | None) -> tuple[int, ...]:
    return tuple(int(d) for d in (text or "").strip("{}").split(",") if d.strip())
