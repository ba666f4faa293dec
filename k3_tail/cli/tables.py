"""How results are written out, for the commands and the experiments: figures in scaled units,
whether two timings can be told apart, text tables (laid out by their specs, or fitted to the
terminal), Markdown tables, and the table of ``bench`` and ``calibrate`` with what it says about the
selection (:func:`format_bench_table`)."""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from k3_tail.selection.rules import select_tier
from k3_tail.tiers.registry import Tier
from k3_tail.units import format_seconds

if TYPE_CHECKING:  # annotations only: the tables need neither a device nor the benchmark
    import jax

    from k3_tail.config import TailConfig
    from k3_tail.selection.decision import TierDecision
    from k3_tail.tools.benchmark import Measurement, Timing

# The space between the columns of a fitted table (format_table(fit=True)).
TABLE_GAP = "  "

# ---- figures ----


def format_ms(seconds: float) -> str:
    """``seconds`` in milliseconds with about 3 significant digits (0.0123, 1.23, 123)."""
    milliseconds = 1e3 * seconds
    digits = next((d for d, bound in ((4, 0.1), (3, 1), (2, 10), (1, 100)) if milliseconds < bound), 0)
    return f"{milliseconds:.{digits}f}"


def quartiles_ms(timing: Timing | Mapping[str, float]) -> str:
    """"q25-q75" in milliseconds of a :class:`Timing` or of a row holding its fields."""
    fields = timing if isinstance(timing, Mapping) else vars(timing)
    return f"{format_ms(fields['q25_s'])}-{format_ms(fields['q75_s'])}"


def spread_ms(timing: Timing | Mapping[str, float]) -> str:
    """"median (q25-q75)" in milliseconds of a :class:`Timing` or of a row holding its fields."""
    fields = timing if isinstance(timing, Mapping) else vars(timing)
    return f"{format_ms(fields['median_s'])} ({quartiles_ms(fields)})"


def format_percent(fraction: float) -> str:
    """``fraction`` as a percentage: one decimal under 10% ("0.4%", "7.1%"), none above ("23%")."""
    percent = 100 * fraction
    return f"{percent:.1f}%" if abs(percent) < 10 else f"{percent:.0f}%"


def within_noise(a: Timing, b: Timing) -> bool:
    """Whether two timings' q25-q75 ranges overlap: the runs cannot tell which of the two is faster."""
    return a.q25_s <= b.q75_s and b.q25_s <= a.q75_s


# ---- tables ----

# A column of format_table: (title, format spec of its cells such as ">9.2f" or "<16", the cell's value).
Column = tuple[str, str, Callable[[Any], Any]]
_ALIGN_AND_WIDTH = re.compile(r"[<>^]?\d*")


def median_columns(timing: Callable[[Any], Timing | Mapping[str, float]],
                   widths: tuple[int, int] = (11, 18)) -> list[Column]:
    """The "median ms" and "q25-q75 ms" columns of :func:`format_table`, of the :class:`Timing` (or the
    row holding its fields) ``timing(row)``, right-aligned in ``widths`` characters."""
    def median(row: Any) -> str:
        fields = timing(row)
        return format_ms(fields["median_s"] if isinstance(fields, Mapping) else fields.median_s)

    return [("median ms", f">{widths[0]}", median),
            ("q25-q75 ms", f">{widths[1]}", lambda row: quartiles_ms(timing(row)))]


def terminal_width() -> int | None:
    """The width to fit output to: ``COLUMNS`` when set, else that of the terminal stdout is on
    (``shutil.get_terminal_size``); None off a terminal (a pipe, a file), where lines may be long."""
    if not os.environ.get("COLUMNS") and not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


def format_table(rows: Iterable[Any], columns: Sequence[Column], *, group: Callable[[Any], Any] | None = None,
                 notes: Sequence[str] = (), fit: bool = False, width: int | None = None) -> str:
    """A text table: the titles, one line per row (each cell ``format(value(row), spec)``), a blank line
    where ``group(row)`` changes, then ``notes``.

    By default the specs' widths lay the columns out, side by side. With ``fit`` each column is as
    wide as its longest cell, columns stand two spaces apart under a rule, and a column whose spec
    starts with ">" (figures) is right-aligned; within ``width`` characters (None: any width;
    :func:`terminal_width` gives the terminal's) the widest columns of text narrow and their cells
    wrap at spaces, down to their longest word, while figures never wrap. Rows then stand a blank
    line apart, so a wrapped row reads as one. Where even that is too wide, each row becomes a block
    of "title: value" lines (:func:`format_blocks`).

    Raises:
        ValueError: ``width`` without ``fit``.
    """
    if width is not None and not fit:
        raise ValueError(f"width: {width} lays out a fitted table only (fit=True)")
    rows = list(rows)
    if fit:
        return "\n".join([_fitted_table(rows, columns, group, width), *notes])
    lines = ["".join(format(title, _ALIGN_AND_WIDTH.match(spec).group()) for title, spec, _ in columns)]
    for row, blank in zip(rows, _group_breaks(rows, group), strict=True):
        lines += [""] * blank + ["".join(format(value(row), spec) for _, spec, value in columns)]
    return "\n".join([*lines, *notes])


def _group_breaks(rows: Sequence[Any], group: Callable[[Any], Any] | None) -> list[bool]:
    """For each row, whether a blank line goes before it: where ``group(row)`` changes."""
    keys = [None if group is None else group(row) for row in rows]
    return [index > 0 and key != keys[index - 1] for index, key in enumerate(keys)]


def _fitted_table(rows: Sequence[Any], columns: Sequence[Column], group: Callable[[Any], Any] | None,
                  width: int | None) -> str:
    """``format_table(fit=True)`` without its notes."""
    header = [title for title, _, _ in columns]
    cells = [[format(value(row), spec) for _, spec, value in columns] for row in rows]
    right = {index for index, (_, spec, _) in enumerate(columns) if spec.startswith(">")}
    widths = [max(map(len, column)) for column in zip(header, *cells, strict=True)]
    words = [max(len(word) for cell in column for word in cell.split() or [""])
             for column in zip(header, *cells, strict=True)]
    budget = sum(widths) if width is None else width - len(TABLE_GAP) * (len(widths) - 1)
    while sum(widths) > budget:
        narrowable = [index for index in range(len(widths)) if index not in right and widths[index] > words[index]]
        if not narrowable:
            return format_blocks(header, cells, width=width)
        widths[max(narrowable, key=widths.__getitem__)] -= 1
    wrapped = [[textwrap.wrap(cell, column_width, break_on_hyphens=False) or [""]
                for cell, column_width in zip(row, widths, strict=True)] for row in (header, *cells)]
    spaced = any(len(lines) > 1 for row in wrapped[1:] for lines in row)

    def text_lines(row_lines: list[list[str]]) -> list[str]:
        return [TABLE_GAP.join(
            (str.rjust if index in right else str.ljust)(lines[line] if line < len(lines) else "", widths[index])
            for index, lines in enumerate(row_lines)).rstrip() for line in range(max(map(len, row_lines)))]

    lines = [*text_lines(wrapped[0]), TABLE_GAP.join("-" * column_width for column_width in widths)]
    for index, (row_lines, blank) in enumerate(zip(wrapped[1:], _group_breaks(rows, group), strict=True)):
        lines += [""] * (blank or (spaced and index > 0)) + text_lines(row_lines)
    return "\n".join(lines)


def format_blocks(header: Sequence[str], rows: Sequence[Sequence[str]], *, width: int) -> str:
    """``rows`` as blocks a blank line apart, for a terminal too narrow for their table: the first
    cell, then one "label: value" line per other cell, indented, wrapped to ``width``."""
    blocks = []
    for row in rows:
        lines = textwrap.wrap(row[0], width, break_on_hyphens=False) or [""]
        for label, cell in zip(header[1:], row[1:], strict=True):
            lines += textwrap.wrap(f"{label}: {cell}", width, initial_indent="  ", subsequent_indent="    ",
                                   break_on_hyphens=False)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], *,
                   right: Collection[int] | None = None) -> str:
    """A Markdown table of ``header`` and ``rows`` (each cell ``str()``, a "|" in it escaped); the columns
    in ``right`` right-aligned, the others left-aligned (None: every column right-aligned)."""
    rule = ["---:" if right is None or index in right else "---" for index in range(len(header))]
    return "\n".join("| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |"
                     for row in (header, rule, *rows))


# ---- the measurement table ----


def describe_config(config: TailConfig) -> str:
    """One line: the config's shapes and numerics, e.g. "H=7168, L=3584, bfloat16, eps 1e-06, scale 1"."""
    text = (f"H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}, eps {config.rms_norm_eps:g}, "
            f"scale {config.routed_scaling_factor:g}")
    minimum = config.quantized_all_reduce_min_bytes
    quantised = (f"{config.all_reduce_quantization}-quantised sums "
                 + ("(vLLM's minimum)" if minimum is None else f">= {minimum} B"))
    flags = [name for name, on in (
        ("no norm", not config.use_latent_norm), ("no shared experts", not config.has_shared_experts),
        ("reduced routed output", config.routed_output_is_reduced),
        ("reduced shared output", config.shared_output_is_reduced), ("sequence-parallel", config.sequence_parallel),
        (f"all_reduce_form {config.all_reduce_form}", config.all_reduce_form != "auto"),
        (f"up projection {getattr(config.up_proj_dtype, 'name', '')}", config.up_proj_dtype is not None),
        ("FP8 activations", config.fp8_activations),
        (quantised, config.all_reduce_quantization is not None),
    ) if on]
    return ", ".join([text, *flags])


def format_vs_fastest(timing: Timing, fastest: Timing) -> str:
    """One tier's median against the fastest's at the same call: "fastest", or how much slower ("+7.1%")."""
    if timing is fastest:
        return "fastest"
    return f"+{format_percent(timing.median_s / fastest.median_s - 1)}"


def format_selection_gap(selected: Tier, timings: Mapping[Tier, Timing]) -> str:
    """How far the selected tier is from the fastest of ``timings`` (the tiers timed at one call):
    "selected native, fastest overlap: selection 7.1% slower (412 us vs 385 us)", "within noise" when
    their q25-q75 ranges overlap; "selected overlap, the fastest"; or "selected overlap (not timed)"."""
    fastest = min(timings, key=lambda tier: timings[tier].median_s)
    if selected not in timings:
        return f"selected {selected.value} (not timed), fastest {fastest.value}"
    if selected == fastest:
        return f"selected {selected.value}, the fastest"
    mine, best = timings[selected], timings[fastest]
    noise = ", within noise: their q25-q75 ranges overlap" if within_noise(mine, best) else ""
    return (f"selected {selected.value}, fastest {fastest.value}: selection "
            f"{format_percent(mine.median_s / best.median_s - 1)} slower ({format_seconds(mine.median_s)} vs "
            f"{format_seconds(best.median_s)}{noise})")


def selected_tiers(measurements: Sequence[Measurement], config: TailConfig, *,
                   device: jax.Device) -> dict[tuple[int, int, str], TierDecision]:
    """What select_tier picks for each call of ``measurements`` (``config``, T, p, layout, on ``device``'s kind
    and platform), by (p, T, weight layout): the tier the bench table stars and its plot rings."""
    return {key: select_tier(config, key[1], key[0], weight_layout=key[2], device_kind=device.device_kind,
                             platform=device)
            for key in dict.fromkeys((m.tp_size, m.num_tokens, m.weight_layout) for m in measurements)}


def format_bench_table(measurements: Sequence[Measurement], config: TailConfig, *, device: jax.Device) -> str:
    """The table of ``bench`` and ``calibrate``: one row per (p, T, tier) with the median, the q25-q75
    spread (ms), the speedup over native at the same (p, T) (median over median; "-" when native
    was not timed) and the median against the fastest tier's there. A "*" marks the tier select_tier
    picks for that call (``config``, T, p, layout, ``device``'s kind and platform); after each (p, T) a line says how
    far that pick is from the fastest (:func:`format_selection_gap`)."""
    blocks: dict[tuple[int, int], list[Measurement]] = {}
    for m in measurements:
        blocks.setdefault((m.tp_size, m.num_tokens), []).append(m)
    selections = selected_tiers(measurements, config, device=device)
    lines = [f"{'p':>4}{'T':>7}  {'tier':<16}{'median ms':>11}{'q25-q75 ms':>19}{'vs native':>11}{'vs fastest':>12}"]
    for (tp_size, num_tokens), block in blocks.items():
        if len(lines) > 1:
            lines.append("")
        timings = {m.tier: m.timing for m in block}
        fastest = min(timings.values(), key=lambda timing: timing.median_s)
        native = timings.get(Tier.NATIVE)
        selection = selections[(tp_size, num_tokens, block[0].weight_layout)]
        for m in block:
            speedup = "-" if native is None else f"{native.median_s / m.timing.median_s:.2f}x"
            spread = quartiles_ms(m.timing)
            selected = " *" if selection.tier == m.tier else ""
            lines.append(f"{tp_size:>4}{num_tokens:>7}  {m.tier.value:<16}{format_ms(m.timing.median_s):>11}"
                         f"{spread:>19}{speedup:>11}{format_vs_fastest(m.timing, fastest):>12}{selected}")
        lines.append(f"{'':>11}p={tp_size} T={num_tokens}: {format_selection_gap(selection.tier, timings)}")
    lines += ["", "* the tier select_tier picks for that call (config, T, p, layout, device kind)",
              "vs fastest: the median against the fastest tier's at that (p, T)"]
    return "\n".join(lines)
