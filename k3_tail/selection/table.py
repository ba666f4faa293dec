"""Measured tier selection: a table of token ranges -> tier, measured on one kind of device and p.

``python -m k3_tail calibrate`` times every tier on the current mesh over a ladder of token counts
(:func:`k3_tail.benchmark.measure_tiers`), keeps the fastest tier per measured T and writes the
result as JSON. ``TailConfig(selection_policy="measured", selection_table=SelectionTable.load(path))``
then makes :func:`k3_tail.select_tier` follow it. Between two measured token counts T_a < T_b the
tier measured fastest at T_a serves [T_a, T_b - 1]; the first range starts at T = 1 and the last
one is open-ended.

A table is only valid where it was measured: the same device kind, TP size, weight layout, hidden
and latent sizes, dtype, up-projection weights (``up_proj_dtype``, ``fp8_activations``; a table
without those keys was measured with the kernel in dtype), whether the shared output arrived
reduced (``shared_output_is_reduced``; absent: it did not) and the quantised sums
(``all_reduce_quantization``, ``quantized_all_reduce_min_bytes``; absent: bf16 sums). Using it
anywhere else raises ValueError
naming what differs, since a table measured on other hardware or shapes would pick tiers for the
wrong reasons.

JSON form (``format`` names the version)::

    {"format": "k3_tail.selection_table/1", "device_kind": "NVIDIA H200", "tp_size": 8,
     "weight_layout": "column", "hidden_size": 7168, "latent_size": 3584, "dtype": "bfloat16",
     "up_proj_dtype": null, "fp8_activations": false, "shared_output_is_reduced": false,
     "all_reduce_quantization": null, "quantized_all_reduce_min_bytes": null, "source": "...",
     "ranges": [{"first": 1, "last": 255, "tier": "overlap"},
                {"first": 256, "last": null, "tier": "column_parallel"}]}
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from k3_tail.config import TailConfig
from k3_tail.tiers.columns import WEIGHT_LAYOUTS
from k3_tail.tiers.registry import Tier

FORMAT = "k3_tail.selection_table/1"


@dataclasses.dataclass(frozen=True)
class TokenRange:
    """Token counts ``first`` <= T <= ``last`` (no upper bound when ``last`` is None) -> ``tier``."""

    first: int
    last: int | None
    tier: Tier

    def __contains__(self, num_tokens: int) -> bool:
        return self.first <= num_tokens and (self.last is None or num_tokens <= self.last)

    def __str__(self) -> str:
        return f"[{self.first}, {'inf' if self.last is None else self.last}] -> {self.tier.value}"


@dataclasses.dataclass(frozen=True)
class SelectionTable:
    """Which tier to use for which token count, measured on ``device_kind`` at ``tp_size`` ranks.

    Frozen and hashable, so a :class:`TailConfig` holding one stays a valid static jit argument.
    """

    device_kind: str
    tp_size: int
    weight_layout: str
    hidden_size: int
    latent_size: int
    dtype: str
    ranges: tuple[TokenRange, ...]
    source: str = ""
    up_proj_dtype: str | None = None
    fp8_activations: bool = False
    shared_output_is_reduced: bool = False
    all_reduce_quantization: str | None = None
    quantized_all_reduce_min_bytes: int | None = None

    def __post_init__(self):
        _check_ranges(self.ranges, self.weight_layout)

    def range_for(self, num_tokens: int) -> TokenRange:
        """The range that holds ``num_tokens`` (>= 1)."""
        return next(r for r in self.ranges if num_tokens in r)

    def check_matches(
        self, config: TailConfig, tp_size: int, *, weight_layout: str | None = None, device_kind: str | None = None
    ) -> None:
        """ValueError naming the first of p, shapes, dtypes, FP8 activations, a reduced shared output, the
        quantised sums, layout or device kind that differs from where the table was measured
        (``weight_layout`` / ``device_kind`` None: not checked)."""
        expected = {
            "tp_size": tp_size,
            "hidden_size": config.hidden_size,
            "latent_size": config.latent_size,
            "dtype": config.dtype.name,
            "up_proj_dtype": _up_proj_dtype_name(config),
            "fp8_activations": config.fp8_activations,
            "shared_output_is_reduced": config.shared_output_is_reduced,
            "all_reduce_quantization": config.all_reduce_quantization,
            "quantized_all_reduce_min_bytes": config.quantized_all_reduce_min_bytes,
            "weight_layout": weight_layout,
            "device_kind": device_kind,
        }
        for name, value in expected.items():
            if (value is not None or name not in _UNCHECKED_WHEN_NONE) and getattr(self, name) != value:
                raise ValueError(
                    f"selection_table: measured with {name}={getattr(self, name)!r}, but this call has "
                    f"{name}={value!r}; calibrate for this setup (python -m k3_tail calibrate)"
                )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "ranges"},
            "ranges": [{"first": r.first, "last": r.last, "tier": r.tier.value} for r in self.ranges],
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as JSON to ``path``."""
        with open(path, "w") as file:
            json.dump(self.to_dict(), file, indent=2)
            file.write("\n")

    @classmethod
    def from_dict(cls, data: Any) -> SelectionTable:
        """A table from its JSON data; ValueError naming the field for anything malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"selection_table: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"selection_table.format: expected {FORMAT!r}, got {data.get('format')!r}")
        fields = {
            "device_kind": str, "tp_size": int, "weight_layout": str, "hidden_size": int, "latent_size": int,
            "dtype": str, "source": str,
        }
        values = {}
        for name, kind in fields.items():
            value = data.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"selection_table.{name}: expected a {kind.__name__}, got {value!r}")
            values[name] = value
        for name in ("tp_size", "hidden_size", "latent_size"):
            if values[name] < 1:
                raise ValueError(f"selection_table.{name}: expected an integer >= 1, got {values[name]!r}")
        # Tables written before FP8 weights existed have neither key: they were measured with the kernel in dtype.
        values["up_proj_dtype"] = data.get("up_proj_dtype")
        if not isinstance(values["up_proj_dtype"], (str, type(None))):
            raise ValueError(f"selection_table.up_proj_dtype: expected a dtype name or null, "
                             f"got {values['up_proj_dtype']!r}")
        # Likewise tables written before a reduced shared output existed were measured with the partials.
        for name in ("fp8_activations", "shared_output_is_reduced"):
            values[name] = data.get(name, False)
            if not isinstance(values[name], bool):
                raise ValueError(f"selection_table.{name}: expected a bool, got {values[name]!r}")
        # And tables written before quantised sums existed were measured with sums in the dtype.
        for name, kind in (("all_reduce_quantization", str), ("quantized_all_reduce_min_bytes", int)):
            values[name] = data.get(name)
            if not isinstance(values[name], (kind, type(None))) or isinstance(values[name], bool):
                raise ValueError(f"selection_table.{name}: expected a {kind.__name__} or null, got {values[name]!r}")
        raw_ranges = data.get("ranges")
        if not isinstance(raw_ranges, list) or not raw_ranges:
            raise ValueError(f"selection_table.ranges: expected a non-empty list, got {raw_ranges!r}")
        ranges = []
        for index, item in enumerate(raw_ranges):
            if not isinstance(item, dict) or set(item) != {"first", "last", "tier"}:
                raise ValueError(f"selection_table.ranges[{index}]: expected {{first, last, tier}}, got {item!r}")
            first, last = item["first"], item["last"]
            if not _is_int(first) or not (last is None or _is_int(last)):
                raise ValueError(f"selection_table.ranges[{index}]: first/last must be integers (last may be null)")
            tier = Tier.parse(item["tier"], argument=f"selection_table.ranges[{index}]")
            ranges.append(TokenRange(first, last, tier))
        return cls(ranges=tuple(ranges), **values)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SelectionTable:
        """Read a table written by :meth:`save` (``python -m k3_tail calibrate``)."""
        try:
            with open(path) as file:
                data = json.load(file)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"selection_table: cannot read {os.fspath(path)!r}: {error}") from None
        return cls.from_dict(data)


def table_from_measurements(
    measurements: Sequence[Any], *, config: TailConfig, device_kind: str, source: str = ""
) -> SelectionTable:
    """The table that picks, for each measured T, the tier with the smallest median time.

    ``measurements``: :class:`k3_tail.benchmark.Measurement` records of one TP size and weight
    layout, every tier at every token count (T >= 1). Consecutive token counts with the same
    winner merge into one range.
    """
    if not measurements:
        raise ValueError("measurements: expected at least one measurement")
    setups = {(m.tp_size, m.weight_layout) for m in measurements}
    if len(setups) != 1:
        raise ValueError(f"measurements: expected one TP size and weight layout, got {sorted(setups)}")
    (tp_size, weight_layout), = setups
    token_counts = sorted({m.num_tokens for m in measurements})
    if token_counts[0] < 1:
        raise ValueError("measurements: token counts must be >= 1 (T = 0 is always served by native)")
    winners = [min((m for m in measurements if m.num_tokens == t), key=lambda m: m.timing.median_s).tier
               for t in token_counts]
    ranges: list[TokenRange] = []
    for index, (num_tokens, tier) in enumerate(zip(token_counts, winners, strict=True)):
        first = 1 if index == 0 else num_tokens
        if ranges and ranges[-1].tier == tier:
            continue
        if ranges:
            ranges[-1] = dataclasses.replace(ranges[-1], last=first - 1)
        ranges.append(TokenRange(first, None, tier))
    return SelectionTable(
        device_kind=device_kind, tp_size=tp_size, weight_layout=weight_layout, hidden_size=config.hidden_size,
        latent_size=config.latent_size, dtype=config.dtype.name, ranges=tuple(ranges), source=source,
        up_proj_dtype=_up_proj_dtype_name(config), fp8_activations=config.fp8_activations,
        shared_output_is_reduced=config.shared_output_is_reduced,
        all_reduce_quantization=config.all_reduce_quantization,
        quantized_all_reduce_min_bytes=config.quantized_all_reduce_min_bytes,
    )


# check_matches arguments that None leaves unchecked; every other field's None is a value to compare.
_UNCHECKED_WHEN_NONE = frozenset({"weight_layout", "device_kind"})


def _up_proj_dtype_name(config: TailConfig) -> str | None:
    return None if config.up_proj_dtype is None else config.up_proj_dtype.name


def _check_ranges(ranges: tuple[TokenRange, ...], weight_layout: str) -> None:
    """Ranges must start at 1, follow each other without gap or overlap and end open."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"selection_table.weight_layout: expected one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    if not ranges or ranges[0].first != 1:
        raise ValueError("selection_table.ranges: expected ranges starting at T = 1")
    for index, token_range in enumerate(ranges):
        last_expected = index == len(ranges) - 1
        if (token_range.last is None) != last_expected:
            raise ValueError(f"selection_table.ranges[{index}]: only the last range is open-ended (last = null)")
        if token_range.last is not None and token_range.last < token_range.first:
            raise ValueError(f"selection_table.ranges[{index}]: last < first")
        if index and token_range.first != ranges[index - 1].last + 1:
            raise ValueError(f"selection_table.ranges[{index}]: expected first = {ranges[index - 1].last + 1}")
        if not token_range.tier.supports(weight_layout):
            raise ValueError(
                f"selection_table.ranges[{index}]: tier {token_range.tier.value} does not run with the "
                f"{weight_layout!r} weight layout"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
