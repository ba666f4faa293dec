"""Plots of benchmark measurements (needs matplotlib: the ``plot`` extra)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from k3_tail.tiers.registry import Tier
from k3_tail.tools.benchmark import Measurement

# The legend's entries beside the tiers' lines.
BAND_LABEL = "band: q25-q75 of the timed runs"
SELECTED_LABEL = "ring: the tier select_tier picks"
# The gid of the rings that mark the selected tier (one line of markers per subplot).
SELECTED_GID = "selected"
# Inches per subplot, and for the legend right of them.
SUBPLOT_WIDTH_IN, LEGEND_WIDTH_IN, HEIGHT_IN = 4.5, 2.6, 4.8
# The share of the figure's width a line of the title may take.
TITLE_WIDTH = 0.95


def measurement_figure(
    measurements: Sequence[Measurement], *, title: str = "",
    selected: Mapping[tuple[int, int, str], Tier] | None = None,
) -> Figure:
    """A log-log figure of median time per call (ms) against T: one subplot per TP size p, one line per
    tier (and weight layout, when there are several) with the q25-q75 range of its timed runs shaded,
    and a ring on the point of the tier ``selected`` maps (p, T, weight layout) to (the tier
    ``select_tier`` picks for that call; None: no rings). One legend, right of the subplots (below the title), names the
    lines, the band and the ring; ``title`` stands above, broken at spaces into lines as wide as the
    figure.

    A bare matplotlib Figure on an Agg canvas: pyplot's global state and backend are left alone.
    """
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 0.4 and 512, not 4x10^-1 and 2^9

    tp_sizes = sorted({m.tp_size for m in measurements})
    layouts = sorted({m.weight_layout for m in measurements})
    lines = [(tier, layout) for layout in layouts for tier in Tier]
    figure = Figure(figsize=(SUBPLOT_WIDTH_IN * len(tp_sizes) + LEGEND_WIDTH_IN, HEIGHT_IN), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(tp_sizes), sharey=True, squeeze=False)[0]
    handles: dict[str, Line2D] = {}  # the tiers' lines by label, for the one legend
    for axis, tp_size in zip(axes, tp_sizes, strict=True):
        rings = []
        for index, (tier, layout) in enumerate(lines):
            rows = sorted(
                (m for m in measurements if (m.tp_size, m.tier, m.weight_layout) == (tp_size, tier, layout)),
                key=lambda m: m.num_tokens,
            )
            if not rows:
                continue
            tokens = [m.num_tokens for m in rows]
            medians = [1e3 * m.timing.median_s for m in rows]
            label = tier.value if len(layouts) == 1 else f"{tier.value} ({layout})"
            # A fixed colour per line, so that a tier looks the same in every subplot.
            (handles[label],) = axis.plot(tokens, medians, marker="o", color=f"C{index}", label=label)
            axis.fill_between(tokens, [1e3 * m.timing.q25_s for m in rows], [1e3 * m.timing.q75_s for m in rows],
                              color=f"C{index}", alpha=0.2, linewidth=0)
            rings += [(m.num_tokens, median) for m, median in zip(rows, medians, strict=True)
                      if selected is not None and selected.get((tp_size, m.num_tokens, layout)) == tier]
        if rings:
            axis.plot(*zip(*rings, strict=True), linestyle="none", marker="o", markersize=12, markerfacecolor="none",
                      markeredgecolor="black", markeredgewidth=1.5, gid=SELECTED_GID, zorder=3)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.xaxis.set_major_formatter(plain)
        # Ticks at 1, 2, 5 x 10^k: a labelled tick even when the times span less than a decade.
        axis.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        axis.yaxis.set_major_formatter(plain)
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel("tokens T")
        axis.set_title(f"p = {tp_size}")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median time per call (ms)")
    legend = [*handles.values(), Patch(facecolor="0.5", alpha=0.3, label=BAND_LABEL)]
    if selected is not None:
        legend.append(Line2D([], [], linestyle="none", marker="o", markersize=12, markerfacecolor="none",
                             markeredgecolor="black", markeredgewidth=1.5, label=SELECTED_LABEL))
    figure.legend(handles=legend, loc="outside right center", fontsize="small")
    if title:
        fit_title(figure, title)
    return figure


def fit_title(figure: Figure, text: str) -> None:
    """Set ``text`` as the figure's title, a line break where the next word would make a line wider than
    :data:`TITLE_WIDTH` of the figure (measured in the title's font on the figure's Agg canvas)."""
    title = figure.suptitle(text)
    renderer = figure.canvas.get_renderer()
    lines: list[str] = []
    for word in text.split():
        title.set_text(f"{lines[-1]} {word}" if lines else word)
        if lines and title.get_window_extent(renderer).width <= TITLE_WIDTH * figure.bbox.width:
            lines[-1] = title.get_text()
        else:
            lines.append(word)
    title.set_text("\n".join(lines))


def plot_measurements(
    measurements: Sequence[Measurement], path: str | os.PathLike | BinaryIO, *, title: str = "",
    selected: Mapping[tuple[int, int, str], Tier] | None = None,
) -> None:
    """:func:`measurement_figure` written as a PNG to ``path``, a file name or a binary file object
    (a notebook's ``io.BytesIO``, to show it without a file)."""
    measurement_figure(measurements, title=title, selected=selected).savefig(path, dpi=120, format="png")
