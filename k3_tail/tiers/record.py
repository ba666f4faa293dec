"""One record per tier: what runs and what it costs, kept beside the tier's function.

Each tier module defines its per-rank function, a :class:`TierRecord` named ``RECORD`` and, in its docstring,
the tier in words (:data:`PROSE_LABELS`). Collective buffers are counted as :mod:`k3_tail.xla.report` counts
them: the reduced buffer of an all-reduce, the input of a reduce-scatter, the gathered result of an all-gather,
the per-rank send buffer of an all-to-all. A ring moves 2(g-1)/g of the buffer per rank for an all-reduce and
(g-1)/g for the others (g ranks).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from k3_tail.config import TailConfig
from k3_tail.ops.columns import column_block_width
from k3_tail.ops.up_projection import gemm_rows
from k3_tail.tiers.context import TierFunction

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL = "all-reduce", "reduce-scatter", "all-gather", "all-to-all"
# The kinds that sum over the ranks (and so may travel quantised: k3_tail.ops.collectives).
SUM_KINDS = (ALL_REDUCE, REDUCE_SCATTER)
# Per-rank ring wire bytes as a multiple of the buffer's bytes, given the group size g.
RING_WIRE_FACTORS = MappingProxyType({
    ALL_REDUCE: lambda g: 2 * (g - 1) / g,
    REDUCE_SCATTER: lambda g: (g - 1) / g,
    ALL_GATHER: lambda g: (g - 1) / g,
    ALL_TO_ALL: lambda g: (g - 1) / g,
})
# The lines of a tier module's docstring that describe it in words (:class:`TierProse`), in its fields' order.
PROSE_LABELS = ("Summary", "Schedule", "Collectives", "Token-sharded output", "Shared output reduced")
# Device platforms (a device's ``.platform``) by the family whose compiler options apply to them.
_PLATFORM_FAMILIES = MappingProxyType({"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu", "tpu": "tpu"})


@dataclasses.dataclass(frozen=True)
class CollectiveTerm:
    """One collective a tier issues on each rank: its kind, its buffer in elements, whether it runs beside the GEMM."""

    kind: str
    elements: int
    beside_gemm: bool = False


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The per-rank sizes of one call that a tier's cost terms depend on. rows: T, or T' (T rounded up to a
    multiple of p, at least p) for token-sharded output and a tier that splits tokens."""

    rows: int
    latent_size: int
    hidden_size: int
    tp_size: int
    weight_layout: str
    has_shared: bool
    use_norm: bool
    routed_output_is_reduced: bool
    token_sharded: bool
    shared_output_is_reduced: bool = False

    @property
    def sums_shared(self) -> bool:
        """Whether the tier itself sums shared partials: they exist and do not arrive reduced."""
        return self.has_shared and not self.shared_output_is_reduced

    @property
    def block_width(self) -> int:
        """Hb = padded_hidden_size(H, p) / p: the width of one rank's column block."""
        return column_block_width(self.hidden_size, self.tp_size)

    @property
    def output_reduction(self) -> str:
        """How a [T, W] sum reaches this rank: an all-reduce, or a reduce-scatter over tokens."""
        return REDUCE_SCATTER if self.token_sharded else ALL_REDUCE

    def latent_reduction(self) -> tuple[CollectiveTerm, ...]:
        """AR(T*L) of the routed partials, which every tier but one_shot starts with (none when reduced)."""
        return () if self.routed_output_is_reduced else (CollectiveTerm(ALL_REDUCE, self.rows * self.latent_size),)

    def column_gather(self) -> tuple[CollectiveTerm, ...]:
        """AG(T*p*Hb) of the [T, Hb] output blocks, when a full-width tier runs on the column layout."""
        if self.weight_layout != "column":
            return ()
        return (CollectiveTerm(ALL_GATHER, self.rows * self.tp_size * self.block_width),)

    def block_assembly(self) -> CollectiveTerm:
        """How a column tier assembles y from [T, Hb] blocks: AG(T*p*Hb), or token-sharded an all-to-all of T*Hb."""
        if self.token_sharded:
            return CollectiveTerm(ALL_TO_ALL, self.rows * self.block_width)
        return CollectiveTerm(ALL_GATHER, self.rows * self.tp_size * self.block_width)


@dataclasses.dataclass(frozen=True)
class GpuKernelCounts:
    """The GPU kernels a tier's compiled call launches besides collectives and copies, {XLA platform: (one token,
    more)} per weight layout it runs with, counted for Kimi-K3 at p = 8: XLA's fusion decisions, not a formula."""

    replicated: Mapping[str, tuple[int, int]]
    column: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def of(self, platform: str, weight_layout: str, num_tokens: int) -> int:
        """The kernels of a call of ``num_tokens`` (0 launches none) on ``platform`` with ``weight_layout``."""
        if num_tokens == 0:
            return 0
        one, more = (self.column if weight_layout == "column" else self.replicated)[platform]
        return one if num_tokens == 1 else more


@dataclasses.dataclass(frozen=True)
class TierProse:
    """A tier in words: its module docstring's lines "Label: text" (continued on lines indented by 4), one field
    per label of :data:`PROSE_LABELS`; AR/RS/AG: all-reduce, reduce-scatter, all-gather of r (routed), s (shared)."""

    summary: str
    schedule: str
    collectives_text: str
    token_sharded_form: str
    shared_reduced_form: str

    @classmethod
    def of_module(cls, module_doc: str) -> TierProse:
        """The prose a tier module's docstring ``module_doc`` states; ValueError naming a missing label."""
        facts, label = {}, None
        for line in module_doc.splitlines():
            head, _, text = line.partition(": ")
            if head in PROSE_LABELS:
                label, facts[head] = head, text.strip()
            elif label is not None and line.startswith("    "):
                facts[label] += " " + line.strip()
            else:
                label = None
        missing = [label for label in PROSE_LABELS if label not in facts]
        if missing:
            raise ValueError(f"module_doc: a tier module's docstring states {', '.join(PROSE_LABELS)}; "
                             f"missing {missing}")
        return cls(*(facts[label] for label in PROSE_LABELS))


@dataclasses.dataclass(frozen=True)
class OwnKernel:
    """A tier's own GPU kernel (one_kernel's Pallas kernel): ``compiled_on``, the device platforms where it
    compiles (elsewhere it runs interpreted); ``rows_per_weight_read``, the token rows of a tile, each tile reading
    the weights once; ``launch_grid`` (config, token rows, p) -> its grid; ``scratch_bytes`` (config, T, p) -> the
    scratch it writes and reads back once a call; ``lowering_setup``, what a program holding it needs done before
    it lowers (None: nothing)."""

    compiled_on: tuple[str, ...]
    rows_per_weight_read: int
    launch_grid: Callable[[TailConfig, int, int], Any]
    scratch_bytes: Callable[[TailConfig, int, int], int]
    lowering_setup: Callable[[], None] | None = None


@dataclasses.dataclass(frozen=True)
class TierRecord:
    """What runs and what it costs, for one tier: ``function``, named ``<name>_tail`` (ValueError otherwise), and
    its words, its module docstring's (:attr:`prose`). ``compiler_options``: per-executable XLA options per
    platform family ("gpu", "cpu", "tpu"). ``needs_whole_kernel``, ``serves_routed_output_is_reduced``,
    ``unavailable`` (config -> why not in this installation, or None): where it cannot run (:meth:`why_not`).
    ``reads_rank``: the entry points pass the rank. ``own_kernel``: its own GPU kernel (:class:`OwnKernel`), or
    None where it runs XLA's kernels only. Cost: ``projects_all_columns`` (all H columns with the replicated
    kernel, else a block of Hb); ``splits_tokens`` (GEMM on T/p rows); ``collectives`` (a :class:`CallShape` ->
    its terms, in issue order); ``gpu_kernels`` (charged by the cost model, checked on compiled programs)."""

    function: TierFunction
    projects_all_columns: bool
    collectives: Callable[[CallShape], tuple[CollectiveTerm, ...]]
    gpu_kernels: GpuKernelCounts
    needs_whole_kernel: bool = False
    serves_routed_output_is_reduced: bool = True
    splits_tokens: bool = False
    compiler_options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    unavailable: Callable[[TailConfig | None], str | None] | None = None
    reads_rank: bool = False
    own_kernel: OwnKernel | None = None

    def __post_init__(self):
        if not self.function.__name__.endswith("_tail"):
            raise ValueError(f"function: expected a tier's function, named <tier name>_tail, got "
                             f"{self.function.__name__!r}")

    @property
    def name(self) -> str:
        return self.function.__name__.removesuffix("_tail")

    @functools.cached_property
    def prose(self) -> TierProse:
        """The tier in words: its module docstring's (:meth:`TierProse.of_module`)."""
        return TierProse.of_module(sys.modules[self.function.__module__].__doc__ or "")

    def why_not(self, weight_layout: str, config: TailConfig | None = None) -> str | None:
        """Why the tier cannot run with ``weight_layout`` and ``config`` (None: not considered), or None."""
        if self.needs_whole_kernel and weight_layout != "replicated":
            return (f"{self.name} needs the whole [L, H] kernel on every rank (weight_layout='replicated'), "
                    f"got weight_layout={weight_layout!r}")
        if not self.serves_routed_output_is_reduced and config is not None and config.routed_output_is_reduced:
            return (f"{self.name} reduces the routed partials itself, so it cannot serve "
                    "routed_output_is_reduced=True")
        return None if self.unavailable is None else self.unavailable(config)

    def check_runs(self, weight_layout: str, config: TailConfig | None = None, *, argument: str = "tier") -> None:
        """ValueError naming ``argument`` with :meth:`why_not`'s reason when the tier cannot run."""
        reason = self.why_not(weight_layout, config)
        if reason is not None:
            raise ValueError(f"{argument}: {reason}")

    def gemm_columns(self, hidden_size: int, tp_size: int, weight_layout: str) -> int:
        """The width of one rank's projection [T, L] x [L, columns]: H or padded_hidden_size(H, p) / p."""
        if self.projects_all_columns and weight_layout == "replicated":
            return hidden_size
        return column_block_width(hidden_size, tp_size)

    def runs_interpreted_on(self, platform: str | None) -> bool:
        """Whether its own kernel runs interpreted (correct, slow: nothing to time) on device ``platform``."""
        return self.own_kernel is not None and platform not in self.own_kernel.compiled_on

    def before_lowering(self, platform: str | None) -> None:
        """Its own kernel's ``lowering_setup`` where it compiles on ``platform``: each program lowers it again."""
        if self.own_kernel is not None and self.own_kernel.lowering_setup is not None and (
                not self.runs_interpreted_on(platform)):
            self.own_kernel.lowering_setup()

    def weight_reads(self, rows: int) -> int:
        """How many times the GEMM reads its kernel for ``rows`` token rows: once, or once per tile of its own
        kernel's ``rows_per_weight_read`` rows."""
        if self.own_kernel is None:
            return 1
        return max(1, -(-rows // self.own_kernel.rows_per_weight_read))

    def gemm_rows(self, rows: int, tp_size: int) -> int:
        """The rows of one rank's projection of ``rows`` token rows: rows / p when it splits tokens, else rows."""
        return rows // tp_size if self.splits_tokens else rows

    def multiplied_rows(self, rows: int, tp_size: int) -> int:
        """The rows its GEMM multiplies: one row as two in :func:`k3_tail.ops.up_projection.project`."""
        rows = self.gemm_rows(rows, tp_size)
        return rows if self.own_kernel is not None else gemm_rows(rows)

    def options_for(self, platform: str) -> dict[str, Any]:
        """The per-executable XLA options for a device ``platform`` ("gpu", "cuda", "rocm", "cpu", ...)."""
        family = _PLATFORM_FAMILIES.get(platform, platform)
        return dict(self.compiler_options.get(family, {}))
