"""Plots of benchmark measurements (needs matplotlib: the ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from k3_tail.tiers.registry import Tier
from k3_tail.tools.benchmark import Measurement


def plot_measurements(measurements: Sequence[Measurement], path: str, *, title: str = "") -> None:
    """Write a log-log PNG of median time per call (ms) against T to ``path``: one subplot per TP
    size, one line per tier (and weight layout, when there are several) with its q25-q75 band shaded.

    Draws on a bare matplotlib Figure (rendered by the Agg backend), leaving pyplot's global state
    and backend alone.
    """
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 0.4 and 512, not 4x10^-1 and 2^9

    tp_sizes = sorted({m.tp_size for m in measurements})
    layouts = sorted({m.weight_layout for m in measurements})
    lines = [(tier, layout) for layout in layouts for tier in Tier]
    figure = Figure(figsize=(4.5 * len(tp_sizes) + 1, 4.5), layout="constrained")
    axes = figure.subplots(1, len(tp_sizes), sharey=True, squeeze=False)[0]
    for axis, tp_size in zip(axes, tp_sizes, strict=True):
        for index, (tier, layout) in enumerate(lines):
            rows = sorted(
                (m for m in measurements if (m.tp_size, m.tier, m.weight_layout) == (tp_size, tier, layout)),
                key=lambda m: m.num_tokens,
            )
            if not rows:
                continue
            tokens = [m.num_tokens for m in rows]
            label = tier.value if len(layouts) == 1 else f"{tier.value} ({layout})"
            # A fixed colour per line, so that a tier looks the same in every subplot.
            axis.plot(tokens, [1e3 * m.timing.median_s for m in rows], marker="o", color=f"C{index}", label=label)
            axis.fill_between(tokens, [1e3 * m.timing.q25_s for m in rows], [1e3 * m.timing.q75_s for m in rows],
                              color=f"C{index}", alpha=0.2, linewidth=0)
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
    axes[-1].legend(fontsize="small")
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=120, format="png")
