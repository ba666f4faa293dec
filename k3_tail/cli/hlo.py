"""``k3-tail hlo``: the XLA report of compiled tail calls, one call or a sweep of them.

Compiles the Kimi-K3 tail for deviceless GPU topologies (``h100x8``, ...), a CPU mesh or this
machine's accelerators. Every flag that names a case takes a comma-separated list (topologies,
token counts, tiers, kernel layouts, kernel variants, codecs and their minimum sizes), and the
command compiles their cross product. One case prints :mod:`k3_tail.xla.report`'s full report
(per-device cost, every collective, whether the shared reduction overlaps the GEMM); several, or
``--columns``, print one row per case with the figures :data:`COLUMNS` describes, in scaled units
(``--markdown``: as Markdown). ``--json`` prints the report, or the rows, as JSON. A tier is the one
:func:`k3_tail.select_tier` picks for the case ("auto", the default), a named one (a case it cannot
run is a one-line error, exit status 2) or ``all``: every tier that runs with the case's layout and
config, the others left out with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from k3_tail.cli.harness import (
    AXIS_NAME,
    MIN_BYTES_NEEDS_CODEC,
    QUANTIZATION_CHOICES,
    CommandError,
    add_devices_argument,
    add_reduced_shared_argument,
    add_up_projection_arguments,
    choice_list,
    demo_devices,
    mesh_decision,
    non_negative_int,
    positive_int,
    positive_int_list,
    stepped,
    tier_values,
    tp_mesh,
    up_projection_options,
)
from k3_tail.cli.tables import describe_config, format_table, markdown_table, terminal_width
from k3_tail.config import TailConfig
from k3_tail.deviceless.topologies import TopologyUnavailable, topology_mesh
from k3_tail.ops.columns import WEIGHT_LAYOUTS
from k3_tail.tiers.registry import Tier
from k3_tail.units import format_bytes
from k3_tail.xla import report as xla_report
from k3_tail.xla.compilation import compile_tail, compiler_options, tail_arguments

DEFAULT_HLO_TOKENS = 16
DEFAULT_TOPOLOGY = "h100x8"
# --tier's words beside the tier values: select_tier's pick, and every tier that runs with the case.
AUTO, ALL = "auto", "all"
# --kernels: the up-projection kernel in the activation dtype, in FP8 (weight-only), in FP8 with FP8
# activations; DEFAULT_FP8_FORMAT is the FP8 format unless --up-proj-dtype names another.
KERNELS = ("bf16", "fp8", "fp8+act")
DEFAULT_FP8_FORMAT = "float8_e4m3fn"
# --quantized-all-reduce-min-bytes's word for vLLM's minimum for the dtype and p (quantized_all_reduce_min_bytes=None).
VLLM_MINIMUM = "vllm"
# --baseline-tokens: the token count the "vs_tokens" column compares with (a one-row GEMM should cost no more
# than a two-row one).
DEFAULT_BASELINE_TOKENS = 2
# --help's column of labels.
EPILOG_LABEL_WIDTH = 16


@dataclasses.dataclass(frozen=True)
class Case:
    """One call to compile: where, how many tokens, which tier (or AUTO), kernel layout and variant, and how its
    sums travel (``codec`` None: unquantised; ``min_bytes`` None: vLLM's minimum)."""

    topology: str
    num_tokens: int
    tier: Tier | str
    weight_layout: str
    kernel: str
    codec: str | None
    min_bytes: int | None

    def config(self, fp8_format: str, reduced_shared: bool) -> TailConfig:
        """The Kimi-K3 TailConfig of this case (CommandError when TailConfig rejects it)."""
        try:
            return TailConfig.kimi_k3(
                shared_output_is_reduced=reduced_shared, up_proj_dtype=None if self.kernel == "bf16" else fp8_format,
                fp8_activations=self.kernel == "fp8+act", all_reduce_quantization=self.codec,
                quantized_all_reduce_min_bytes=self.min_bytes,
            )
        except ValueError as error:
            raise CommandError(f"config: {error}") from None

    @property
    def sums(self) -> str:
        """How the sums travel, in words: "unquantised", "int8, every sum", "int8, vLLM minimum",
        "int8, >= 4.00 KiB"."""
        if self.codec is None:
            return "unquantised"
        if self.min_bytes is None:
            return f"{self.codec}, vLLM minimum"
        return f"{self.codec}, every sum" if self.min_bytes == 0 else f"{self.codec}, >= {format_bytes(self.min_bytes)}"


@dataclasses.dataclass(frozen=True)
class Column:
    """A column of the sweep table: its label, what it shows (for ``--help``), and its cell text of a row."""

    label: str
    meaning: str
    text: Callable[[dict[str, Any]], str]
    numeric: bool = True


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# The case's labels: shown as columns where the sweep varies them, else once above the table.
CASE_COLUMNS = {
    "topology": Column("topology", "the --topology compiled for", lambda row: row["topology"], numeric=False),
    "T": Column("T", "the token count", lambda row: str(row["num_tokens"])),
    "tier": Column("tier", "the tier compiled; \"(auto)\": select_tier's pick for the case",
                   lambda row: row["tier"] + (" (auto)" if row["auto"] else ""), numeric=False),
    "layout": Column("layout", "where the up-projection kernel lives: column-sharded or replicated",
                     lambda row: row["weight_layout"], numeric=False),
    "kernel": Column("kernel", "the kernel variant: bf16, fp8 (weights) or fp8+act (weights and activations)",
                     lambda row: row["kernel"], numeric=False),
    "sums": Column("sums", "how the TP sums travel: unquantised, or a codec for every sum, above vLLM's minimum "
                   "size or above a given size", lambda row: row["sums"], numeric=False),
}
# The figures, per device, by --columns name.
COLUMNS = {
    "accessed": Column("accessed", "bytes accessed: the operand and result bytes of every top-level instruction "
                       "(a GEMM that reads its kernel once counts it once; a copy of the kernel, or a float32 product "
                       "the size of the kernel, counts again)", lambda row: format_bytes(row["bytes_accessed"])),
    "vs_tokens": Column("x T={baseline}", "accessed against the same case's at T = --baseline-tokens (\"-\" where "
                        "that T is not in the sweep)", lambda row: _ratio(row["accessed_vs_baseline_tokens"])),
    "temp": Column("temp", "the temporary buffers the program needs beside its arguments and result, from XLA's "
                   "memory analysis (a copy of a kernel block shows here)",
                   lambda row: "-" if row["temp_bytes"] is None else format_bytes(row["temp_bytes"])),
    "gemms": Column("GEMMs", "the instructions that run a GEMM (0: XLA rewrote the product into a multiply and a "
                    "reduce)", lambda row: str(row["gemms"])),
    "gpu_kernels": Column("GPU kernels", "the GPU kernels the program launches besides its collectives and copies, "
                          "from XLA's thunk sequence (\"-\" for a CPU program)",
                          lambda row: "-" if row["gpu_kernels"] is None else str(row["gpu_kernels"])),
    "kernel_held": Column("kernel held", "the bytes of the kernel argument(s) each device holds (FP8: values and "
                          "float32 scales)", lambda row: format_bytes(row["kernel_bytes"])),
    "gemm_reads": Column("GEMM reads", "the element types of the arrays the GEMMs read",
                         lambda row: ", ".join(row["gemm_operand_types"]), numeric=False),
    "kernel_read": Column("kernel read", "the bytes of the kernel (or this rank's block of it) the GEMMs read: "
                          "their operands of L x H or L x H/p elements, float32 products excluded",
                          lambda row: format_bytes(row["gemm_kernel_bytes"])),
    "wire": Column("wire", "the ring wire bytes of all collectives: (g-1)/g of each all-to-all's send buffer and "
                   "all-gather's result, 2(g-1)/g of each all-reduce's buffer (g: the group size)",
                   lambda row: format_bytes(row["wire_bytes"])),
    "vs_unquantised": Column("x unquantised", "wire against the same case's with unquantised sums (\"-\" where "
                             "that case is not in the sweep)", lambda row: _ratio(row["wire_vs_unquantised"])),
    "collectives": Column("collectives", "each collective's form and the element types it carries (u8: a "
                          "quantised payload)", lambda row: ", ".join(row["collectives"]), numeric=False),
    "overlapped": Column("overlapped", "whether the shared reduction runs async with a GEMM inside it (False on "
                         "the CPU, whose collectives are synchronous; None: no shared reduction)",
                         lambda row: str(row["overlapped"]), numeric=False),
}
DEFAULT_COLUMNS = ("accessed", "temp", "gemms", "gpu_kernels", "wire", "overlapped")


HELP = "compile tail calls (one, or a sweep) and report their cost, collectives and overlap"
DESCRIPTION = (
    "Compile Kimi-K3 tail calls for deviceless GPU topologies (no GPU needed), a CPU mesh or this machine's "
    "accelerators. Each flag that names a case takes a comma-separated list; the command compiles every combination. "
    "One case prints its full report: per-device FLOPs and bytes, every collective (kind, shape, bytes, async or not, "
    "what is scheduled inside it) and whether the shared reduction overlaps the GEMM. Several cases (or --columns) "
    "print a table, one row per case."
)


def add_arguments(hlo: argparse.ArgumentParser) -> None:
    """``hlo``'s flags: the cases to compile and the output; its ``--help`` ends with :func:`help_epilog`."""
    hlo.epilog = help_epilog()
    hlo.add_argument(
        "--tier", "--tiers", dest="tiers", type=hlo_tier_list, default=(AUTO,), metavar="TIER,...",
        help=f"tiers to compile, of {tier_values()}; {AUTO}: what select_tier picks for each case; {ALL}: every "
        f"tier that runs with the case's layout and config (default: {AUTO})",
    )
    hlo.add_argument(
        "--tokens", type=positive_int_list, default=(DEFAULT_HLO_TOKENS,), metavar="T,...",
        help=f"token counts T (default: {DEFAULT_HLO_TOKENS})",
    )
    hlo.add_argument(
        "--topology", type=lambda text: tuple(name.strip() for name in text.split(",")), default=(DEFAULT_TOPOLOGY,),
        metavar="NAME,...",
        help=f"h100x8, h200x8, mi300xx8, mi355xx8 (<target>x<count>, deviceless), cpu (--devices CPU devices) or "
        f"local (this machine's accelerators) (default: {DEFAULT_TOPOLOGY})",
    )
    add_devices_argument(hlo, "CPU devices for --topology cpu")
    hlo.add_argument(
        "--weight-layout", type=choice_list(WEIGHT_LAYOUTS, "layouts"), default=("column",), metavar="LAYOUT,...",
        help="where the up-projection kernel lives, of column (column-sharded) and replicated (default: column)",
    )
    hlo.add_argument(
        "--kernels", type=choice_list(KERNELS, "kernel variants"), metavar="KERNEL,...",
        help=f"kernel variants, of {', '.join(KERNELS)} (fp8: FP8 weights in --up-proj-dtype's format, default "
        f"{DEFAULT_FP8_FORMAT}; fp8+act: FP8 activations too) (default: what --up-proj-dtype and --fp8-activations "
        "say)",
    )
    add_up_projection_arguments(hlo)
    add_reduced_shared_argument(hlo)
    hlo.add_argument(
        "--all-reduce-quantization", type=choice_list(QUANTIZATION_CHOICES, "codecs"), default=("none",),
        metavar="CODEC,...",
        help=f"how the TP sums travel, of {', '.join(QUANTIZATION_CHOICES)}: unquantised, or block-quantised in "
        "the codec as two-shot all-reduces like vLLM ROCm's QuickReduce (default: none)",
    )
    hlo.add_argument(
        "--quantized-all-reduce-min-bytes", type=minimum_size_list, default=None, metavar="N,...",
        help=f"with a codec: quantise only sums of buffers of at least N bytes; {VLLM_MINIMUM}: vLLM's minimum for "
        f"the dtype and p (default: {VLLM_MINIMUM})",
    )
    output = hlo.add_argument_group("output")
    output.add_argument(
        "--columns", type=choice_list(tuple(COLUMNS), "columns"), metavar="NAME,...",
        help=f"the table's figures, of {', '.join(COLUMNS)} (below); a table even for one case (default: "
        f"{','.join(DEFAULT_COLUMNS)})",
    )
    output.add_argument(
        "--baseline-tokens", type=positive_int, default=DEFAULT_BASELINE_TOKENS, metavar="T",
        help=f"the token count the vs_tokens column compares with (default: {DEFAULT_BASELINE_TOKENS})",
    )
    output.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    output.add_argument("--json", action="store_true", help="print the report, or the table's rows, as JSON")


def help_epilog() -> str:
    """``--help``'s account of the output: every label of the table and of the one-case report, and the units.
    One line per paragraph and per label, which :class:`~k3_tail.cli.harness.HelpFormatter` wraps to the
    terminal, a label's text continuing in its column."""
    entries = [(column.label, column.meaning) for column in CASE_COLUMNS.values()]
    entries += [(name if name == column.label.lower() else f"{name} ({column.label.format(baseline='N')})",
                 column.meaning) for name, column in COLUMNS.items()]
    lines = ["The table: one row per case, figures per device. The case's labels are columns where the sweep varies "
             "them, else said once above the table. --columns names the figures:"]
    for label, meaning in entries:
        if len(label) < EPILOG_LABEL_WIDTH:
            lines.append(f"  {label:<{EPILOG_LABEL_WIDTH}}{meaning}")
        else:  # a label too long for the column stands on its own line
            lines += [f"  {label}", " " * (EPILOG_LABEL_WIDTH + 2) + meaning]
    lines.append("Bytes in B, KiB, MiB, GiB (powers of 1024) and FLOPs in MFLOP, GFLOP, ... (powers of 1000) as the "
                 "figure needs; x: a ratio.")
    lines.append("")
    lines.append(
        "The report of one case, per device, in the same units: \"per device\": "
        "all FLOPs, bytes accessed (as above) and where they come from (XLA's cost analysis, or the HLO shapes where "
        "the backend has none), the GEMMs' FLOPs; \"arguments per device\": each argument's shard; \"GEMMs\": "
        "[schedule position] name: FLOPs, the arrays it reads; \"collectives\": form, buffers (named scopes): "
        "bytes, group size, ring wire bytes per rank, sync [position] or async [start..done], \"<- shared "
        "reduction\" on the first that carries the shared partial; \"scheduled inside\": the instructions between "
        "an async start and done; \"overlapped\": whether the shared reduction runs async with a GEMM inside it.")
    return "\n".join(lines)


def _case_label(case) -> str:
    """What the progress bar names for a sweep case."""
    tier = case.tier if case.tier == AUTO else case.tier.value
    return f"{case.topology} T={case.num_tokens} {tier} {case.weight_layout} {case.kernel} {case.sums}"


def hlo_tier_list(text: str) -> tuple[Tier | str, ...]:
    """A comma-separated list of tier values, ``auto`` and ``all`` (argparse type)."""
    tiers = []
    for item in (item.strip() for item in text.split(",")):
        try:
            tiers.append(item if item in (AUTO, ALL) else Tier.parse(item))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected tiers among {tier_values()}, {AUTO}, {ALL}, got {item!r}"
            ) from None
    return tuple(dict.fromkeys(tiers))


def minimum_size_list(text: str) -> tuple[int | None, ...]:
    """A comma-separated list of byte counts >= 0 and ``vllm`` (None: vLLM's minimum) (argparse type)."""
    return tuple(None if item.strip() == VLLM_MINIMUM else non_negative_int(item.strip()) for item in text.split(","))


def kernel_variants(args: argparse.Namespace) -> tuple[tuple[str, ...], str]:
    """(The kernel variants to compile, the FP8 format): ``--kernels``, or the one variant that
    ``--up-proj-dtype`` and ``--fp8-activations`` describe."""
    if args.kernels is None:
        options = up_projection_options(args)
        kernel = "bf16" if options["up_proj_dtype"] is None else "fp8+act" if options["fp8_activations"] else "fp8"
        return (kernel,), options["up_proj_dtype"] or DEFAULT_FP8_FORMAT
    if args.fp8_activations:
        raise CommandError("--fp8-activations: with --kernels, name fp8+act there instead")
    return args.kernels, args.up_proj_dtype or DEFAULT_FP8_FORMAT


def sum_options(args: argparse.Namespace) -> list[dict[str, object]]:
    """The TailConfig fields of each way the sums travel: no codec once, each codec at each minimum size."""
    codecs = [None if name == "none" else name for name in dict.fromkeys(args.all_reduce_quantization)]
    if args.quantized_all_reduce_min_bytes is not None and codecs == [None]:
        raise CommandError(MIN_BYTES_NEEDS_CODEC)
    minima = tuple(dict.fromkeys(args.quantized_all_reduce_min_bytes or (None,)))
    return [{"all_reduce_quantization": codec, "quantized_all_reduce_min_bytes": minimum}
            for codec in codecs for minimum in ((None,) if codec is None else minima)]


def run(args: argparse.Namespace) -> int:
    """The ``hlo`` command: check the flags, compile every case, print the report or the table (text or JSON)."""
    kernels, fp8_format = kernel_variants(args)
    sums = sum_options(args)
    meshes = {topology: hlo_mesh(topology, args.devices) for topology in dict.fromkeys(args.topology)}
    cases, left_out = sweep_cases(args, meshes, kernels, sums, fp8_format)
    if len(cases) == 1 and args.columns is None:
        return print_report(args, cases[0], meshes[cases[0].topology], fp8_format)
    rows = [case_row(case, meshes[case.topology], case.config(fp8_format, args.reduced_shared))
            for case in stepped(cases, _case_label)]
    add_ratios(rows, args.baseline_tokens)
    if args.json:
        print(json.dumps({"baseline_tokens": args.baseline_tokens, "left_out": left_out, "rows": rows}, indent=2))
        return 0
    print(f"config: Kimi-K3 tail, {describe_config(TailConfig.kimi_k3(shared_output_is_reduced=args.reduced_shared))}"
          "; figures per device")
    for note in left_out:
        print(f"not compiled: {note}")
    print(format_rows(rows, args.columns or DEFAULT_COLUMNS, args.baseline_tokens, markdown=args.markdown))
    return 0


def hlo_mesh(topology: str, cpu_device_count: int) -> Mesh:
    """The 1-d TP mesh to compile on: a deviceless topology, CPU devices or the local accelerators
    (CommandError where there are none)."""
    if topology == "cpu":
        devices = demo_devices(cpu_device_count, accelerators=False)
    elif topology == "local":
        if jax.default_backend() == "cpu":
            raise CommandError("--topology local: this machine has no accelerators (JAX's backend is cpu); "
                               "use --topology cpu for a CPU mesh or a deviceless one such as h100x8")
        devices = jax.devices()
    else:
        try:
            return topology_mesh(topology, axis_name=AXIS_NAME)
        except (ValueError, TopologyUnavailable) as error:
            raise CommandError(f"--topology: {error}") from None
    return tp_mesh(devices)


def sweep_cases(
    args: argparse.Namespace, meshes: dict[str, Mesh], kernels: Sequence[str], sums: Sequence[dict[str, object]],
    fp8_format: str,
) -> tuple[list[Case], list[str]]:
    """(The cases of the flags' cross product, in the order topology, T, tier, layout, kernel, sums; the notes
    on what ``all`` left out, each naming the tier and the layout it cannot run with). AUTO resolves to
    select_tier's pick; a named tier that cannot run with a case is a CommandError."""
    cases, left_out = [], []
    named = [tier for tier in args.tiers if tier != ALL]
    expanded = [*named, *(tier for tier in Tier if tier not in named)] if ALL in args.tiers else named
    for topology, num_tokens, tier, layout, kernel, options in itertools.product(
        meshes, args.tokens, expanded, args.weight_layout, kernels, sums
    ):
        case = Case(topology, num_tokens, tier, layout, kernel, options["all_reduce_quantization"],
                    options["quantized_all_reduce_min_bytes"])
        if tier == AUTO:
            cases.append(case)
            continue
        reason = tier.why_not(layout, case.config(fp8_format, args.reduced_shared))
        if reason is None:
            cases.append(case)
        elif tier in named:
            raise CommandError(f"--tier: {reason}")
        elif (note := f"{tier.value} with the {layout} layout, because {reason}") not in left_out:
            left_out.append(note)  # the case left out, not the tier: it may run with the sweep's other layout
    if not cases:
        raise CommandError("--tier: no tier runs with these layouts and configs")
    return cases, left_out


def case_tier(case: Case, mesh: Mesh, config: TailConfig) -> tuple[Tier, str]:
    """(The tier ``case`` compiles, why): select_tier's pick for AUTO, else the named tier."""
    if case.tier != AUTO:
        return case.tier, "forced by --tier"
    selection = mesh_decision(config, case.num_tokens, mesh, case.weight_layout)
    return selection.tier, f"selected: {selection.reason}"


def compile_case(case: Case, mesh: Mesh, config: TailConfig
                 ) -> tuple[jax.stages.Compiled, xla_report.XlaReport, Tier, str]:
    """(``case`` compiled, its report with the GPU kernels it launches, its tier, why that tier); CommandError when
    the tail refuses the call."""
    tier, why = case_tier(case, mesh, config)
    with tempfile.TemporaryDirectory(prefix="k3_tail_hlo_") as dump_dir:
        # Only a GPU program's dump lists kernels (its thunk sequence): a CPU compile is not dumped.
        dump_to = None if mesh.devices.flat[0].platform == "cpu" else dump_dir
        try:
            compiled = compile_tail(config, mesh, case.num_tokens, tier=tier, axis_name=AXIS_NAME,
                                    weight_layout=case.weight_layout, dump_to=dump_to)
        except ValueError as error:  # e.g. the one_shot tier with the column layout
            raise CommandError(str(error)) from None
        return compiled, xla_report.report(compiled, dump_dir=dump_to), tier, why


def print_report(args: argparse.Namespace, case: Case, mesh: Mesh, fp8_format: str) -> int:
    """One case: its full report, as text or JSON."""
    config = case.config(fp8_format, args.reduced_shared)
    _, report, tier, why = compile_case(case, mesh, config)
    tp_size = mesh.shape[AXIS_NAME]
    options = compiler_options(tier, mesh.devices.flat[0])
    if args.json:
        print(json.dumps({
            "topology": case.topology, "tier": tier.value, "tier_reason": why, "num_tokens": case.num_tokens,
            "tp_size": tp_size, "weight_layout": case.weight_layout, "compiler_options": options,
            "up_proj_dtype": None if config.up_proj_dtype is None else config.up_proj_dtype.name,
            "fp8_activations": config.fp8_activations, "shared_output_is_reduced": args.reduced_shared,
            "all_reduce_quantization": config.all_reduce_quantization,
            "quantized_all_reduce_min_bytes": config.quantized_all_reduce_min_bytes, "report": report.to_dict(),
        }, indent=2))
        return 0
    print(f"tier: {tier.value} ({why}); T={case.num_tokens}, p={tp_size}, kernel layout {case.weight_layout}")
    print(f"config: Kimi-K3 tail, {describe_config(config)}")
    print(f"topology: {case.topology}; compiler options: {options or 'none'}")
    print(report.format())
    return 0


def case_row(case: Case, mesh: Mesh, config: TailConfig) -> dict[str, Any]:
    """The table row of ``case``: the case and its figures per device (plain data)."""
    compiled, report, tier, why = compile_case(case, mesh, config)
    tp_size = mesh.shape[AXIS_NAME]
    # The tail's own arguments come first (then the per-rank inputs its tier reads); the kernel is the last of them,
    # an FP8 kernel's float32 scales after its values.
    own = tail_arguments(config, mesh, case.num_tokens, axis_name=AXIS_NAME, weight_layout=case.weight_layout)
    arguments = report.arguments[:len(jax.tree.leaves(own))]
    kernel_arguments = arguments[-1:] if config.up_proj_dtype is None else arguments[-2:]
    kernel_elements = {config.latent_size * config.hidden_size, config.latent_size * config.hidden_size // tp_size}
    operands = [array for gemm in report.gemms for array in gemm.operands]
    memory = compiled.memory_analysis()
    return {
        "topology": case.topology, "tp_size": tp_size, "num_tokens": case.num_tokens, "tier": tier.value,
        "auto": case.tier == AUTO, "tier_reason": why, "weight_layout": case.weight_layout, "kernel": case.kernel,
        "up_proj_dtype": None if config.up_proj_dtype is None else config.up_proj_dtype.name,
        "fp8_activations": config.fp8_activations, "all_reduce_quantization": case.codec,
        "quantized_all_reduce_min_bytes": case.min_bytes, "sums": case.sums,
        "bytes_accessed": report.bytes_accessed,
        "temp_bytes": None if memory is None else memory.temp_size_in_bytes,
        "gemms": len(report.gemms),
        "gpu_kernels": report.gpu_kernel_count,
        "kernel_bytes": sum(array.bytes for array in kernel_arguments),
        "gemm_operand_types": sorted({array.dtype for array in operands}),
        "gemm_kernel_bytes": sum(array.bytes for array in operands
                                 if array.elements in kernel_elements and array.dtype != "f32"),
        "wire_bytes": sum(collective.wire_bytes for collective in report.collectives),
        "collectives": sorted(f"{c.form} {'+'.join(c.payload_dtypes)}" for c in report.collectives),
        "overlapped": report.overlapped,
    }


def add_ratios(rows: list[dict[str, Any]], baseline_tokens: int) -> None:
    """Add each row's ratios: bytes accessed against the same case's at ``baseline_tokens``, wire bytes
    against the same case's with unquantised sums (None where the sweep lacks that case)."""

    def key(row: dict[str, Any], *fields: str) -> tuple:
        return tuple(row[field] for field in ("topology", "tier", "weight_layout", "kernel", *fields))

    accessed = {key(row, "sums"): row["bytes_accessed"] for row in rows if row["num_tokens"] == baseline_tokens}
    wire = {key(row, "num_tokens"): row["wire_bytes"] for row in rows if row["all_reduce_quantization"] is None}
    for row in rows:
        baseline, plain = accessed.get(key(row, "sums")), wire.get(key(row, "num_tokens"))
        row["accessed_vs_baseline_tokens"] = None if not baseline else row["bytes_accessed"] / baseline
        row["wire_vs_unquantised"] = None if not plain else row["wire_bytes"] / plain


def format_rows(rows: Sequence[dict[str, Any]], columns: Sequence[str], baseline_tokens: int, *,
                markdown: bool) -> str:
    """The sweep table: the case's labels that vary, then ``columns``; the labels that do not, said above it."""
    constant = {name: column for name, column in CASE_COLUMNS.items()
                if name != "tier" and len({column.text(row) for row in rows}) == 1}
    shown = [column for name, column in CASE_COLUMNS.items() if name not in constant]
    shown += [COLUMNS[name] for name in columns]
    header = [column.label.format(baseline=baseline_tokens) for column in shown]
    if markdown:
        right = {index for index, column in enumerate(shown) if column.numeric}
        table = markdown_table(header, [[column.text(row) for column in shown] for row in rows], right=right)
    else:
        table = format_table(rows, [(title, ">" if column.numeric else "<", column.text)
                                    for title, column in zip(header, shown, strict=True)],
                             fit=True, width=terminal_width())
    above = "; ".join(f"{column.label} {column.text(rows[0])}" for column in constant.values())
    return f"{above}\n\n{table}" if above else table
