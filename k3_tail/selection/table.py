"""Measured tier selection: a table of token ranges -> tier, measured on one kind of device and p.

``python -m k3_tail calibrate`` times every tier on the current mesh over a ladder of token counts
(:func:`k3_tail.tools.benchmark.measure_tiers`), keeps the fastest tier per measured T and writes the
result as JSON. A table is a selection policy: ``TailConfig(selection_policy=SelectionTable.load(path))``
makes :func:`k3_tail.select_tier` follow it. Between two measured token counts T_a < T_b the tier
measured fastest at T_a serves [T_a, T_b - 1]; the first range starts at T = 1 and the last one is
open-ended.

A table is only valid where it was measured: the same device kind, TP size, weight layout, hidden
and latent sizes, dtype, up-projection weights (``up_proj_dtype``, ``fp8_activations``; a table
without those keys was measured with the kernel in dtype), whether the shared output arrived
reduced (``shared_output_is_reduced``; absent: it did not) and the quantised sums
(``all_reduce_quantization``, ``quantized_all_reduce_min_bytes``; absent: bf16 sums). Using it
anywhere else raises ValueError
naming what differs, since a table measured on other hardware or shapes would pick tiers for the
wrong reasons.

The schema is strict: :meth:`SelectionTable.load` (and :meth:`SelectionTable.from_dict`, and the
constructor for every field) refuses with a ValueError naming the field, and the file, a key it does
not know (at the top level or in a range), a key given twice in one JSON object (``load`` reads the
file with :mod:`k3_tail.json_files`: a regular file of strict UTF-8 JSON), and any value that
no TailConfig, codec, FP8 format, weight layout or tier takes (ints are non-bool integers >= their
minimum, bools are JSON booleans, dtypes are TailConfig's names). Limits: a file of at most
``MAX_FILE_BYTES`` (1 MiB, checked before it is parsed) and at most ``MAX_RANGES`` (4096) ranges; a
table of 4096 ranges written by :meth:`SelectionTable.save` takes about 0.3 MB. ``range_for``
(what ``select_tier`` asks) bisects the ranges' first token counts, O(log n); a table computes its
hash once, so a TailConfig holding one hashes (as jit does at every call) in O(1) too. Equality
stays equality of the fields.

JSON form (``format`` names the version)::

    {"format": "k3_tail.selection_table/1", "device_kind": "NVIDIA H200", "tp_size": 8,
     "weight_layout": "column", "hidden_size": 7168, "latent_size": 3584, "dtype": "bfloat16",
     "up_proj_dtype": null, "fp8_activations": false, "shared_output_is_reduced": false,
     "all_reduce_quantization": null, "quantized_all_reduce_min_bytes": null, "source": "...",
     "ranges": [{"first": 1, "last": 255, "tier": "overlap"},
                {"first": 256, "last": null, "tier": "column_parallel"}]}
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax

from k3_tail.config import ALL_REDUCE_QUANTIZATIONS, TailConfig
from k3_tail.hardware import check_platform
from k3_tail.json_files import read_json
from k3_tail.ops.columns import WEIGHT_LAYOUTS
from k3_tail.ops.up_projection import FP8_FORMATS
from k3_tail.output_files import write_file
from k3_tail.policy import SelectionPolicy
from k3_tail.selection.decision import TierDecision
from k3_tail.tiers.registry import Tier

FORMAT = "k3_tail.selection_table/1"
# The largest table file load reads (checked before parsing) and the most ranges a table holds.
MAX_FILE_BYTES = 2**20
MAX_RANGES = 4096


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
class SelectionTable(SelectionPolicy):
    """Which tier to use for which token count, measured on ``device_kind`` at ``tp_size`` ranks: a
    selection policy (``TailConfig(selection_policy=table)``).

    Frozen and hashable, so a :class:`TailConfig` holding one stays a valid static jit argument; the
    hash is computed once, at construction (equal tables hash alike). Every field is checked here
    (module docstring), ValueError naming it.
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
        self._check_fields()
        if isinstance(self.ranges, list):
            object.__setattr__(self, "ranges", tuple(self.ranges))
        _check_ranges(self.ranges, self.weight_layout)
        self._cache()

    def _check_fields(self) -> None:
        for name in ("device_kind", "weight_layout", "dtype", "source"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"selection_table.{name}: expected a string, got {getattr(self, name)!r}")
        if not self.device_kind:
            raise ValueError("selection_table.device_kind: expected a device kind (jax.Device.device_kind), got ''")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"selection_table.weight_layout: expected one of {WEIGHT_LAYOUTS}, "
                             f"got {self.weight_layout!r}")
        for name in ("tp_size", "hidden_size", "latent_size"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("fp8_activations", "shared_output_is_reduced"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"selection_table.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.up_proj_dtype is not None and self.up_proj_dtype not in FP8_FORMATS:
            # The kernel in the activations' dtype is written null: TailConfig reads that dtype as None too.
            raise ValueError(f"selection_table.up_proj_dtype: expected null or one of {FP8_FORMATS}, "
                             f"got {self.up_proj_dtype!r}")
        if not isinstance(self.all_reduce_quantization, (str, type(None))) or (
                self.all_reduce_quantization not in ALL_REDUCE_QUANTIZATIONS):
            names = ", ".join("null" if name is None else repr(name) for name in ALL_REDUCE_QUANTIZATIONS)
            raise ValueError(f"selection_table.all_reduce_quantization: expected one of {names}, "
                             f"got {self.all_reduce_quantization!r}")
        if self.quantized_all_reduce_min_bytes is not None:
            _check_int("quantized_all_reduce_min_bytes", self.quantized_all_reduce_min_bytes, minimum=0)
        # The rest as TailConfig itself takes it: the dtype's name, FP8 activations only with FP8 weights.
        try:
            config = TailConfig(
                hidden_size=self.hidden_size, latent_size=self.latent_size, dtype=self.dtype,
                up_proj_dtype=self.up_proj_dtype, fp8_activations=self.fp8_activations,
                shared_output_is_reduced=self.shared_output_is_reduced,
                all_reduce_quantization=self.all_reduce_quantization,
            )
        except ValueError as error:  # TailConfig's message starts with the field's name
            raise ValueError(f"selection_table.{error}") from None
        if config.dtype.name != self.dtype:
            raise ValueError(f"selection_table.dtype: expected TailConfig's name {config.dtype.name!r} for it, "
                             f"got {self.dtype!r}")

    def _cache(self) -> None:
        """What range_for and hash use, computed once (not fields: equality, repr and pickles skip them)."""
        object.__setattr__(self, "_firsts", tuple(token_range.first for token_range in self.ranges))
        object.__setattr__(self, "_hash", hash(self._values()))

    def _values(self) -> tuple:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._hash == other._hash and self._values() == other._values()

    def __getstate__(self) -> dict[str, Any]:
        # Only the fields: a hash computed in one process (its string hash seed) must not travel to another.
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._cache()

    def range_for(self, num_tokens: int) -> TokenRange:
        """The range that holds ``num_tokens`` (>= 1): a bisection over the ranges' first token counts."""
        index = bisect.bisect_right(self._firsts, num_tokens) - 1
        if index < 0:
            raise ValueError(f"num_tokens: expected an integer >= 1, got {num_tokens!r}")
        return self.ranges[index]

    def select(self, config: TailConfig, num_tokens: int, tp_size: int, *, weight_layout: str | None = None,
               device_kind: str | None = None, platform: str | jax.Device | None = None) -> TierDecision:
        """The tier of the range that holds ``num_tokens``, after :meth:`check_matches` (ValueError when
        the call is not where the table was measured; ``platform``, checked as :func:`k3_tail.select_tier`
        checks it, does not enter: the device kind says more)."""
        check_platform(platform)
        self.check_matches(config, tp_size, weight_layout=weight_layout, device_kind=device_kind)
        token_range = self.range_for(num_tokens)
        source = f", {self.source}" if self.source else ""
        return TierDecision(token_range.tier, f"measured selection table ({self.device_kind}, p={self.tp_size}, "
                                              f"{self.weight_layout} layout{source}): T={num_tokens} in {token_range}")

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
        """Write the table as JSON to ``path``, atomically (:func:`k3_tail.output_files.write_file`: a reader
        sees the old file or the whole new one). ValueError naming ``selection_table``, writing nothing, when
        the JSON would be more than ``MAX_FILE_BYTES`` (a long ``source`` can make it so) or ``path`` is no
        file that can be written (:func:`k3_tail.output_files.check_output_file`: a directory, a FIFO, a
        device, a missing directory, ...)."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if len(text.encode()) > MAX_FILE_BYTES:
            raise ValueError(f"selection_table: its JSON would be {len(text.encode())} bytes, more than the "
                             f"{MAX_FILE_BYTES}-byte limit that load reads; shorten source")
        write_file("selection_table", path, text)

    @classmethod
    def from_dict(cls, data: Any) -> SelectionTable:
        """A table from its JSON data; ValueError naming the field for anything malformed or an unknown key."""
        if not isinstance(data, dict):
            raise ValueError(f"selection_table: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"selection_table.format: expected {FORMAT!r}, got {data.get('format')!r}")
        _check_keys("selection_table", data, _TABLE_KEYS)
        for name in _REQUIRED_KEYS:
            if name not in data:
                raise ValueError(f"selection_table.{name}: missing")
        # Tables written before FP8 weights, a reduced shared output or quantised sums existed lack those
        # keys: they were measured with the kernel in dtype, the shared partials, and sums in dtype.
        values = {**_OPTIONAL_KEYS, **{name: value for name, value in data.items() if name not in ("format", "ranges")}}
        raw_ranges = data["ranges"]
        if not isinstance(raw_ranges, list) or not raw_ranges:
            raise ValueError(f"selection_table.ranges: expected a non-empty list, got {raw_ranges!r}")
        if len(raw_ranges) > MAX_RANGES:
            raise ValueError(f"selection_table.ranges: expected at most {MAX_RANGES} ranges, got {len(raw_ranges)}")
        ranges = []
        for index, item in enumerate(raw_ranges):
            where = f"selection_table.ranges[{index}]"
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected {{first, last, tier}}, got {item!r}")
            _check_keys(where, item, _RANGE_KEYS)
            missing = [name for name in _RANGE_KEYS if name not in item]
            if missing:
                raise ValueError(f"{where}.{missing[0]}: missing")
            if not isinstance(item["tier"], str):
                raise ValueError(f"{where}.tier: expected a tier name, got {item['tier']!r}")
            tier = Tier.parse(item["tier"], argument=f"{where}.tier")
            ranges.append(TokenRange(item["first"], item["last"], tier))
        return cls(ranges=tuple(ranges), **values)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SelectionTable:
        """Read a table written by :meth:`save` (``python -m k3_tail calibrate``); ValueError naming the
        field and ``path`` for anything :meth:`from_dict` refuses, and naming ``path`` for a file that
        :func:`k3_tail.json_files.read_json` refuses (no regular file, more than ``MAX_FILE_BYTES``,
        checked before it is parsed, not UTF-8 JSON, a key given twice in one object)."""
        data = read_json(path, what="selection_table", field_prefix="selection_table.", max_bytes=MAX_FILE_BYTES)
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{error} (in {os.fspath(path)!r})") from None


def table_from_measurements(
    measurements: Sequence[Any], *, config: TailConfig, device_kind: str, source: str = ""
) -> SelectionTable:
    """The table that picks, for each measured T, the tier with the smallest median time.

    ``measurements``: :class:`k3_tail.tools.benchmark.Measurement` records of one TP size and weight
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

# The JSON keys: "format", every field, and of a range its three.
_TABLE_KEYS = ("format", *(field.name for field in dataclasses.fields(SelectionTable)))
_OPTIONAL_KEYS = {field.name: field.default for field in dataclasses.fields(SelectionTable)
                  if field.default is not dataclasses.MISSING and field.name != "source"}
_REQUIRED_KEYS = tuple(name for name in _TABLE_KEYS if name not in _OPTIONAL_KEYS)
_RANGE_KEYS = ("first", "last", "tier")


def _check_keys(where: str, data: dict, known: Sequence[str]) -> None:
    """ValueError naming the first key of ``data`` not in ``known``."""
    for key in data:
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown key; expected keys among {', '.join(known)}")


def _up_proj_dtype_name(config: TailConfig) -> str | None:
    return None if config.up_proj_dtype is None else config.up_proj_dtype.name


def _check_ranges(ranges: tuple[TokenRange, ...], weight_layout: str) -> None:
    """At most MAX_RANGES TokenRanges of integer bounds and a Tier, which start at 1, follow each other
    without gap or overlap, end open and run with ``weight_layout``."""
    if not isinstance(ranges, tuple):
        raise ValueError(f"selection_table.ranges: expected a tuple of TokenRange, got {type(ranges).__name__}")
    if len(ranges) > MAX_RANGES:
        raise ValueError(f"selection_table.ranges: expected at most {MAX_RANGES} ranges, got {len(ranges)}")
    for index, token_range in enumerate(ranges):
        if not isinstance(token_range, TokenRange):
            raise ValueError(f"selection_table.ranges[{index}]: expected a TokenRange, got {token_range!r}")
        _check_int(f"ranges[{index}].first", token_range.first, minimum=1)
        if token_range.last is not None:
            _check_int(f"ranges[{index}].last", token_range.last, minimum=1, none="null or ")
        if not isinstance(token_range.tier, Tier):
            raise ValueError(f"selection_table.ranges[{index}].tier: expected a k3_tail.Tier, got {token_range.tier!r}")
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


def _check_int(name: str, value: Any, *, minimum: int, none: str = "") -> None:
    """ValueError naming ``selection_table.<name>`` unless ``value`` is an int (no bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"selection_table.{name}: expected {none}an integer >= {minimum}, got {value!r}")
