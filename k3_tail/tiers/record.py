"""One record per tier: what runs and what it costs, kept beside the tier's function.

Each tier module defines its per-rank function, a :class:`TierRecord` named ``RECORD`` and, in its docstring,
the tier in words (:data:`PROSE_LABELS`: what it is, its schedule, its collectives, how token-sharded output
and a reduced shared output change it). The ordered registry (:mod:`k3_tail.tiers.registry`) lists the records
and is the only list of tiers; selection, the cost model, compilation, the commands and the README's tier table
read a tier's facts from its record.

Collective buffers are counted as :mod:`k3_tail.xla.report` counts them: the reduced buffer of an
all-reduce, the input of a reduce-scatter, the gathered result of an all-gather, the per-rank send
buffer of an all-to-all. A ring moves 2(g-1)/g of the buffer per rank for an all-reduce and (g-1)/g
for the others (g ranks).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from k3_tail.config import TailConfig
from k3_tail.ops.columns import padded_hidden_size
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
    """One collective a tier issues on each rank: its kind, its buffer in elements, and whether it
    runs beside the tier's GEMM (hidden behind it) rather than before or after it."""

    kind: str
    elements: int
    beside_gemm: bool = False


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The per-rank sizes of one call that a tier's cost terms depend on.

    rows: the token rows the tier works on (T; for token-sharded output, and for a tier that splits
    tokens, T' = T rounded up to a multiple of p, at least p: each rank's output then is T'/p of
    them). The other fields are the config's and the call's: L, H, p, the kernel's layout, whether a
    shared partial exists, whether the norm runs, whether the routed output arrives reduced, whether
    the output is token-sharded, and whether the shared output arrives reduced.
    """

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
        return padded_hidden_size(self.hidden_size, self.tp_size) // self.tp_size

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
        """How a column tier assembles y from the ranks' [T, Hb] blocks
        (:func:`k3_tail.ops.columns.assemble_column_blocks`): AG(T*p*Hb), or for token-sharded output
        an all-to-all whose per-rank send buffer is T*Hb."""
        if self.token_sharded:
            return CollectiveTerm(ALL_TO_ALL, self.rows * self.block_width)
        return CollectiveTerm(ALL_GATHER, self.rows * self.tp_size * self.block_width)


@dataclasses.dataclass(frozen=True)
class GpuKernelCounts:
    """The GPU kernels a tier's compiled call launches besides its collectives and copies, as XLA's thunk
    sequence lists them (:mod:`k3_tail.xla.launches`): for one token and for more, per XLA platform ("cuda",
    "rocm") and weight layout.

    Counted in the programs :func:`k3_tail.compile_tail` makes for Kimi-K3 at p = 8 (T = 1 and 16; the
    same on jax 0.10.2 and 0.12, on MI300X and MI355X alike), which the compiled-program tests compare
    them with. They are XLA's fusion decisions, not a formula: other shapes and forms (quantised sums,
    a reduced shared output) may launch one or two more or fewer.
    """

    counts: Mapping[tuple[str, str], tuple[int, int]]

    @classmethod
    def measured(cls, *, cuda: Mapping[str, tuple[int, int]], rocm: Mapping[str, tuple[int, int]]) -> GpuKernelCounts:
        """From {layout: (one token, more)} per platform."""
        return cls(MappingProxyType({(platform, layout): pair for platform, by_layout in
                                     (("cuda", cuda), ("rocm", rocm)) for layout, pair in by_layout.items()}))

    def of(self, platform: str, weight_layout: str, num_tokens: int) -> int:
        """The kernels of a call of ``num_tokens`` (0 launches none) on ``platform`` with ``weight_layout``."""
        if num_tokens == 0:
            return 0
        one, more = self.counts[(platform, weight_layout)]
        return one if num_tokens == 1 else more


@dataclasses.dataclass(frozen=True)
class TierProse:
    """A tier in words, as its module docstring states it on lines "Label: text" (continued on lines indented
    by 4), the labels of :data:`PROSE_LABELS` in this order: summary, what it is in one line; schedule, its steps
    in the notation AR/RS/AG (all-reduce, reduce-scatter, all-gather; r the routed, s the shared partial);
    collectives_text, its collectives per rank in that notation; token_sharded_form, how it returns token-sharded
    output; shared_reduced_form, how its schedule changes when the shared output arrives reduced."""

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
class TierRecord:
    """What runs and what it costs, for one tier; its words are its module docstring's (:attr:`prose`).

    What runs: ``name``, the tier's value ("overlap"); ``function``, the per-rank
    :class:`~k3_tail.tiers.context.TierFunction`; ``compiler_options``, the per-executable XLA options per
    platform family ("gpu", "cpu", "tpu"); where it cannot run: ``needs_whole_kernel`` (the replicated layout
    only), ``serves_routed_output_is_reduced`` and ``unavailable`` (why not with a config in this installation,
    or None: one_kernel's Pallas Triton backend, which a jax may lack), together :meth:`why_not`;
    ``reads_rank``: its ranks read their own index, which the entry points pass as an argument.
    Its own kernel, for a tier that has one (one_kernel): ``compiled_on``, the device platforms where it compiles
    (elsewhere it runs interpreted; None: XLA's kernels, compiled everywhere); ``lowering_setup``, what a
    program holding it needs before it lowers (:meth:`before_lowering`); ``launch_grid`` (config, token rows,
    p) -> its grid; ``scratch_bytes`` (config, T, p) -> the scratch it writes and reads back once a call.
    What it costs: ``projects_all_columns`` (with the replicated kernel each rank projects all H columns, else
    its block of Hb); ``splits_tokens`` (it works on T rounded up to a multiple of p, at least p, and its GEMM
    on T/p rows); ``rows_per_weight_read`` (the token rows of a GEMM tile where it reads its kernel once per
    tile, :meth:`weight_reads`; None: once); ``collectives`` (its :class:`CollectiveTerm` for a
    :class:`CallShape`, in issue order); ``gpu_kernels`` (the GPU kernels its compiled call launches, which the
    cost model charges and the compiled-program tests compare with XLA's thunk sequence).
    """

    name: str
    function: TierFunction
    projects_all_columns: bool
    collectives: Callable[[CallShape], tuple[CollectiveTerm, ...]]
    gpu_kernels: GpuKernelCounts
    needs_whole_kernel: bool = False
    serves_routed_output_is_reduced: bool = True
    splits_tokens: bool = False
    compiler_options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    unavailable: Callable[[TailConfig | None], str | None] | None = None
    rows_per_weight_read: int | None = None
    compiled_on: tuple[str, ...] | None = None
    scratch_bytes: Callable[[TailConfig, int, int], int] | None = None
    reads_rank: bool = False
    launch_grid: Callable[[TailConfig, int, int], Any] | None = None
    lowering_setup: Callable[[], None] | None = None

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
        """The width of one rank's projection [T, L] x [L, columns]: H when the tier projects all
        columns with the replicated kernel, else its column block padded_hidden_size(H, p) / p."""
        if self.projects_all_columns and weight_layout == "replicated":
            return hidden_size
        return padded_hidden_size(hidden_size, tp_size) // tp_size

    def runs_interpreted_on(self, platform: str | None) -> bool:
        """Whether its kernel runs interpreted (correct, slow: nothing to time) on device ``platform``."""
        return self.compiled_on is not None and platform not in self.compiled_on

    def before_lowering(self, platform: str | None) -> None:
        """Make the warnings context ready for a program holding the tier's kernel to lower on device ``platform``
        (its ``lowering_setup``, where the kernel compiles there): jit caches a trace, but every program holding it
        lowers the kernel again, in the context it lowers in."""
        if self.lowering_setup is not None and not self.runs_interpreted_on(platform):
            self.lowering_setup()

    def weight_reads(self, rows: int) -> int:
        """How many times the tier's GEMM reads its kernel for ``rows`` token rows: once, or for a tier whose
        tiles hold at most ``rows_per_weight_read`` rows (one_kernel's), once per such tile."""
        if self.rows_per_weight_read is None:
            return 1
        return max(1, -(-rows // self.rows_per_weight_read))

    def gemm_rows(self, rows: int, tp_size: int) -> int:
        """The rows of one rank's projection when the tier works on ``rows`` token rows: its own
        rows / p when it shards tokens, else all of them."""
        return rows // tp_size if self.splits_tokens else rows

    def multiplied_rows(self, rows: int, tp_size: int) -> int:
        """The rows its GEMM multiplies for :meth:`gemm_rows`: one row as two where the GEMM is
        :func:`k3_tail.ops.up_projection.project` (every tier but one_kernel, whose tiles read rows as they are)."""
        rows = self.gemm_rows(rows, tp_size)
        return rows if self.rows_per_weight_read is not None else gemm_rows(rows)

    def options_for(self, platform: str) -> dict[str, Any]:
        """The per-executable XLA options for a device ``platform`` ("gpu", "cuda", "rocm", "cpu", ...)."""
        family = _PLATFORM_FAMILIES.get(platform, platform)
        return dict(self.compiler_options.get(family, {}))
