"""Figures in the unit that keeps about three significant digits (bytes, FLOPs, seconds), for every report."""

from __future__ import annotations


def format_bytes(count: float) -> str:
    """``count`` bytes in a binary unit: "512 B", "12.3 KiB", "6.13 MiB", "1.50 GiB"."""
    return _scaled(count, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))


def format_flops(count: float) -> str:
    """``count`` FLOPs in a decimal unit: "822 MFLOP", "13.2 GFLOP"."""
    return _scaled(count, 1000, ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"))


def _scaled(count: float, base: int, units: tuple[str, ...]) -> str:
    """``count`` in the largest of ``units`` (each ``base`` times the one before) that keeps it >= 1."""
    value, unit = float(count), units[0]
    for larger in units[1:]:
        if abs(value) < base:
            break
        value, unit = value / base, larger
    if unit == units[0]:
        return f"{value:.0f} {unit}"
    return f"{value:.{_decimals(value)}f} {unit}"


def format_seconds(seconds: float) -> str:
    """``seconds`` as "812 us", "1.23 ms", "2.50 s"."""
    for scale, unit in ((1e-3, "us"), (1.0, "ms")):
        if seconds < scale:
            value = seconds / scale * 1e3
            return f"{value:.{_decimals(value)}f} {unit}"
    return f"{seconds:.{_decimals(seconds)}f} s"


def _decimals(value: float) -> int:
    """Decimals that show about 3 significant digits of ``value`` (at least 1, under 1000)."""
    return 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
