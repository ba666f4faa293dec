"""Measured selection: tables from measurements, their JSON form, and select_tier following them."""

import dataclasses
import json
import pickle
import subprocess
import sys

import pytest

from helpers import command_environment, make_tp_mesh
from k3_tail import TailConfig, Tier, select_tier, tail_forward
from k3_tail.cli import main
from k3_tail.selection.cost_model import CostModelPolicy
from k3_tail.selection.table import (
    FORMAT,
    MAX_FILE_BYTES,
    MAX_RANGES,
    SelectionTable,
    TokenRange,
    table_from_measurements,
)
from k3_tail.tools.benchmark import Measurement, Timing
from reference import TOLERANCE, make_inputs, reference_tail, relative_error

CONFIG = TailConfig(hidden_size=96, latent_size=64)


def measured(num_tokens, medians, tp_size=8, weight_layout="column"):
    """Measurements at one T, ``medians`` mapping tier -> median seconds."""
    return [
        Measurement(tier, num_tokens, tp_size, weight_layout, Timing(median, median, median, median, median, 3))
        for tier, median in medians.items()
    ]


def table(ranges, **changes):
    fields = dict(device_kind="cpu", tp_size=8, weight_layout="column", hidden_size=96, latent_size=64,
                  dtype="bfloat16", ranges=ranges)
    return SelectionTable(**{**fields, **changes})


TWO_RANGES = (TokenRange(1, 63, Tier.OVERLAP), TokenRange(64, None, Tier.COLUMN_PARALLEL))


def test_each_measured_token_count_starts_a_range_of_its_fastest_tier():
    measurements = (
        measured(1, {Tier.OVERLAP: 1.0, Tier.COLUMN_PARALLEL: 2.0})
        + measured(8, {Tier.OVERLAP: 1.0, Tier.COLUMN_PARALLEL: 3.0})
        + measured(64, {Tier.OVERLAP: 5.0, Tier.COLUMN_PARALLEL: 4.0})
        + measured(512, {Tier.OVERLAP: 9.0, Tier.COLUMN_PARALLEL: 8.0})
    )
    result = table_from_measurements(measurements, config=CONFIG, device_kind="cpu")
    assert result.ranges == TWO_RANGES
    assert (result.tp_size, result.weight_layout, result.dtype) == (8, "column", "bfloat16")


def test_measurements_of_several_setups_are_rejected():
    mixed = measured(1, {Tier.OVERLAP: 1.0}) + measured(1, {Tier.OVERLAP: 1.0}, tp_size=4)
    with pytest.raises(ValueError, match="measurements: expected one TP size"):
        table_from_measurements(mixed, config=CONFIG, device_kind="cpu")


def test_json_round_trip(tmp_path):
    path = tmp_path / "table.json"
    original = table(TWO_RANGES, source="unit test")
    original.save(path)
    assert json.loads(path.read_text())["format"] == FORMAT
    assert SelectionTable.load(path) == original


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "v0"}, "selection_table.format"),
        ({"tp_size": "8"}, "selection_table.tp_size"),
        ({"ranges": []}, "selection_table.ranges"),
        ({"ranges": [{"first": 2, "last": None, "tier": "overlap"}]}, "starting at T = 1"),
        ({"ranges": [{"first": 1, "last": 9, "tier": "overlap"}]}, "only the last range is open-ended"),
        ({"ranges": [{"first": 1, "last": 9, "tier": "overlap"}, {"first": 11, "last": None, "tier": "native"}]},
         "expected first = 10"),
        ({"ranges": [{"first": 1, "last": None, "tier": "tier0"}]}, r"selection_table.ranges\[0\]"),
        ({"ranges": [{"first": 1, "last": None, "tier": "one_shot"}]}, "does not run with the 'column'"),
    ],
    ids=["format", "type", "no_ranges", "gap_at_start", "closed_end", "gap", "unknown_tier", "layout"],
)
def test_malformed_tables_are_value_errors_naming_the_field(tmp_path, change, message):
    data = {**table(TWO_RANGES).to_dict(), **change}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        SelectionTable.load(path)


def test_unreadable_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        SelectionTable.load(tmp_path / "missing.json")


@pytest.mark.parametrize(("num_tokens", "tier"), [(1, Tier.OVERLAP), (63, Tier.OVERLAP), (64, Tier.COLUMN_PARALLEL),
                                                  (10**6, Tier.COLUMN_PARALLEL)])
def test_select_tier_follows_the_table_and_names_it(num_tokens, tier):
    config = dataclasses.replace(CONFIG, selection_policy=table(TWO_RANGES))
    decision = select_tier(config, num_tokens, 8, weight_layout="column", device_kind="cpu")
    assert decision.tier == tier
    assert decision.reason.startswith("measured selection table (cpu, p=8, column layout)")


def test_preconditions_still_come_first():
    config = dataclasses.replace(CONFIG, selection_policy=table(TWO_RANGES))
    assert select_tier(config, 0, 8).tier == Tier.NATIVE


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (dict(tp_size=4), "tp_size=8"),
        (dict(weight_layout="replicated"), "weight_layout='column'"),
        (dict(device_kind="NVIDIA H200"), "device_kind='cpu'"),
    ],
    ids=["tp_size", "layout", "device_kind"],
)
def test_a_table_measured_elsewhere_is_a_value_error(call, message):
    config = dataclasses.replace(CONFIG, selection_policy=table(TWO_RANGES))
    arguments = {"tp_size": 8, "weight_layout": "column", "device_kind": "cpu", **call}
    with pytest.raises(ValueError, match=f"selection_table: measured with {message}"):
        select_tier(config, 16, arguments.pop("tp_size"), **arguments)


@pytest.mark.parametrize(
    ("measured_with", "config_changes", "message"),
    [({}, {"up_proj_dtype": "float8_e4m3fn"}, "up_proj_dtype=None"),
     ({"up_proj_dtype": "float8_e4m3fn"}, {"up_proj_dtype": "float8_e4m3fn", "fp8_activations": True},
      "fp8_activations=False")],
    ids=["fp8-weights", "fp8-activations"],
)
def test_a_table_measured_with_other_up_projection_weights_is_a_value_error(measured_with, config_changes, message):
    measured = dataclasses.replace(table(TWO_RANGES), **measured_with)
    config = dataclasses.replace(CONFIG, selection_policy=measured, **config_changes)
    with pytest.raises(ValueError, match=f"selection_table: measured with {message}"):
        select_tier(config, 16, 8)


def test_a_table_written_before_fp8_weights_reads_as_measured_with_the_kernel_in_dtype(tmp_path):
    data = table(TWO_RANGES).to_dict()
    del data["up_proj_dtype"], data["fp8_activations"]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    assert SelectionTable.load(path) == table(TWO_RANGES)


def test_a_table_for_other_shapes_is_a_value_error():
    config = TailConfig(hidden_size=99, latent_size=64, selection_policy=table(TWO_RANGES))
    with pytest.raises(ValueError, match="hidden_size=96"):
        select_tier(config, 16, 8)


@pytest.mark.parametrize("policy", ["fastest", "measured", "table.json"])
def test_a_policy_that_is_no_selection_policy_is_a_value_error(policy):
    with pytest.raises(ValueError, match="^selection_policy"):
        dataclasses.replace(CONFIG, selection_policy=policy)


@pytest.mark.parametrize("hardware", [None, "tpu"], ids=["model_without_hardware", "unknown_hardware"])
def test_the_cost_model_policy_needs_a_known_preset(hardware):
    with pytest.raises(ValueError, match="^hardware"):
        CostModelPolicy(hardware)


def test_tail_forward_checks_the_device_kind_of_its_mesh():
    config = dataclasses.replace(CONFIG, selection_policy=table(TWO_RANGES, device_kind="AMD Instinct MI355X"))
    inputs = make_inputs(config, 8, 4)
    with pytest.raises(ValueError, match="device_kind"):
        tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=config,
                     mesh=make_tp_mesh(8), weight_layout="column")


def run_cli(*argv):
    environment = command_environment()
    return subprocess.run([sys.executable, "-m", "k3_tail", *argv], capture_output=True, text=True, env=environment,
                          timeout=600, check=False)


def test_calibrate_writes_a_table_that_tail_forward_follows(tmp_path):
    path = tmp_path / "table.json"
    result = run_cli("calibrate", "--out", str(path), "--tokens", "1,8", "--hidden-size", "96", "--latent-size", "64",
                     "--repeats", "1", "--tp-size", "4")
    assert result.returncode == 0, result.stderr
    measured_table = SelectionTable.load(path)
    assert (measured_table.device_kind, measured_table.tp_size, measured_table.weight_layout) == ("cpu", 4, "column")
    assert "selection table" in result.stdout and "Traceback" not in result.stderr
    config = dataclasses.replace(CONFIG, selection_policy=measured_table)
    inputs = make_inputs(config, 4, 8)
    y = tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=config,
                     mesh=make_tp_mesh(4), weight_layout="column")
    assert relative_error(y, reference_tail(config, inputs)) <= TOLERANCE[config.dtype]
    decision = select_tier(config, 8, 4, weight_layout="column", device_kind="cpu")
    assert decision.tier == measured_table.range_for(8).tier and "k3-tail calibrate" in decision.reason


def test_calibrate_into_a_missing_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "missing" / "table.json")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("k3-tail calibrate: error: --out") and error.count("\n") == 1


# ---- a strict schema at load: unknown keys, invalid values, duplicates, size ----


def write_table(tmp_path, data=None, text=None):
    """``data`` (default: a valid table's dict) as JSON, or ``text`` as is, in tmp_path/table.json."""
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table(TWO_RANGES).to_dict() if data is None else data) if text is None else text)
    return path


@pytest.mark.parametrize("key", ["tp_sizee", "all_reduce_quantisation", "comment"])
def test_an_unknown_top_level_key_is_refused_naming_it_and_the_file(tmp_path, key):
    path = write_table(tmp_path, {**table(TWO_RANGES).to_dict(), key: 8})
    with pytest.raises(ValueError, match=rf"selection_table\.{key}: unknown key.*{path.name}"):
        SelectionTable.load(path)


def test_an_unknown_key_in_a_range_is_refused_naming_it(tmp_path):
    data = table(TWO_RANGES).to_dict()
    data["ranges"][1]["tiers"] = "native"
    with pytest.raises(ValueError, match=r"selection_table\.ranges\[1\]\.tiers: unknown key"):
        SelectionTable.load(write_table(tmp_path, data))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("all_reduce_quantization", "int5"),
        ("all_reduce_quantization", 8),
        ("up_proj_dtype", "float8_e5m2"),
        ("up_proj_dtype", "bfloat16"),  # the unquantised kernel is written null; this never matches a config
        ("dtype", "float64"),
        ("dtype", "half"),  # numpy's alias of float16: TailConfig's name is "float16"
        ("weight_layout", "rows"),
        ("device_kind", ""),
        ("tp_size", True),
        ("tp_size", 0),
        ("hidden_size", 96.0),
        ("fp8_activations", 1),
        ("fp8_activations", True),  # without an FP8 up_proj_dtype
        ("shared_output_is_reduced", "false"),
        ("quantized_all_reduce_min_bytes", -1),
        ("quantized_all_reduce_min_bytes", True),
        ("quantized_all_reduce_min_bytes", 1.5),
        ("source", None),
    ],
)
def test_an_invalid_value_is_refused_at_load_naming_the_field_and_the_file(tmp_path, name, value):
    path = write_table(tmp_path, {**table(TWO_RANGES).to_dict(), name: value})
    with pytest.raises(ValueError, match=rf"selection_table\.{name}: .*{path.name}"):
        SelectionTable.load(path)


@pytest.mark.parametrize(
    ("item", "field"),
    [({"first": 64.0, "last": None, "tier": "column_parallel"}, "first"),
     ({"first": 64, "last": False, "tier": "column_parallel"}, "last"),
     ({"first": 64, "last": None, "tier": 3}, "tier")],
)
def test_an_invalid_range_value_is_refused_naming_the_range(tmp_path, item, field):
    data = table(TWO_RANGES).to_dict()
    data["ranges"][1] = item
    with pytest.raises(ValueError, match=rf"selection_table\.ranges\[1\]\.{field}: "):
        SelectionTable.load(write_table(tmp_path, data))


def test_a_duplicated_top_level_key_is_refused_naming_it_and_the_file(tmp_path):
    text = json.dumps(table(TWO_RANGES).to_dict())
    path = write_table(tmp_path, text=text.replace('"tp_size": 8', '"tp_size": 4, "tp_size": 8'))
    with pytest.raises(ValueError, match=rf"selection_table\.tp_size: duplicate key.*{path.name}"):
        SelectionTable.load(path)


def test_a_duplicated_key_in_a_range_is_refused_naming_the_range(tmp_path):
    text = json.dumps(table(TWO_RANGES).to_dict())
    text = text.replace('"tier": "column_parallel"', '"tier": "native", "tier": "column_parallel"')
    with pytest.raises(ValueError, match=r"selection_table\.ranges\[1\]\.tier: duplicate key"):
        SelectionTable.load(write_table(tmp_path, text=text))


def test_a_file_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "table.json"
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1))  # no JSON at all: parsing would fail otherwise
    with pytest.raises(ValueError, match=rf"more than the {MAX_FILE_BYTES}-byte limit") as error:
        SelectionTable.load(path)
    assert path.name in str(error.value)


def many_ranges(count):
    """``count`` ranges of two token counts each, alternating overlap and column_parallel; the last open."""
    tiers = (Tier.OVERLAP, Tier.COLUMN_PARALLEL)
    return tuple(TokenRange(1 + 2 * i, None if i == count - 1 else 2 + 2 * i, tiers[i % 2]) for i in range(count))


def test_more_ranges_than_the_limit_are_refused(tmp_path):
    data = table(TWO_RANGES).to_dict()
    data["ranges"] = [{"first": r.first, "last": r.last, "tier": r.tier.value} for r in many_ranges(MAX_RANGES + 1)]
    with pytest.raises(ValueError, match=rf"selection_table\.ranges: expected at most {MAX_RANGES} ranges, got "):
        SelectionTable.load(write_table(tmp_path, data))


def test_a_table_with_the_most_ranges_loads_and_selects_each_range(tmp_path):
    original = table(many_ranges(MAX_RANGES))
    path = tmp_path / "table.json"
    original.save(path)
    loaded = SelectionTable.load(path)
    assert loaded == original
    config = dataclasses.replace(CONFIG, selection_policy=loaded)
    for num_tokens, tier in [(1, Tier.OVERLAP), (2, Tier.OVERLAP), (3, Tier.COLUMN_PARALLEL),
                             (2 * MAX_RANGES - 2, Tier.OVERLAP), (2 * MAX_RANGES - 1, Tier.COLUMN_PARALLEL),
                             (10**9, Tier.COLUMN_PARALLEL)]:
        assert select_tier(config, num_tokens, 8).tier == tier, num_tokens
    assert [loaded.range_for(r.first) for r in loaded.ranges] == list(loaded.ranges)
    assert [loaded.range_for(r.last) for r in loaded.ranges[:-1]] == list(loaded.ranges[:-1])


def test_equal_tables_are_equal_and_hash_alike_as_do_their_configs(tmp_path):
    loaded = SelectionTable.load(write_table(tmp_path))
    built = table(tuple(dataclasses.replace(r) for r in TWO_RANGES))
    assert loaded == built and hash(loaded) == hash(built)
    assert loaded != table(TWO_RANGES, tp_size=4)
    assert loaded != table((TokenRange(1, 63, Tier.NATIVE), TWO_RANGES[1]))
    configs = [dataclasses.replace(CONFIG, selection_policy=t) for t in (loaded, built)]
    assert configs[0] == configs[1] and hash(configs[0]) == hash(configs[1])
    assert {configs[0]: "jit cache entry"}[configs[1]] == "jit cache entry"


class CountingRanges(tuple):
    """A table's ranges that count the ranges read from them (each one iterated or indexed) and their hashing."""

    calls = 0

    def __iter__(self):
        for token_range in super().__iter__():
            CountingRanges.calls += 1
            yield token_range

    def __getitem__(self, index):
        CountingRanges.calls += 1
        return super().__getitem__(index)

    def __hash__(self):
        CountingRanges.calls += 1
        return super().__hash__()


def with_counting_ranges(measured_table):
    """``measured_table`` with its ranges swapped for a :class:`CountingRanges` of the same ranges."""
    object.__setattr__(measured_table, "ranges", CountingRanges(measured_table.ranges))
    CountingRanges.calls = 0
    return measured_table


def test_hashing_a_table_or_a_config_holding_it_does_not_read_its_ranges():
    measured_table = table(many_ranges(64))
    config = dataclasses.replace(CONFIG, selection_policy=measured_table)
    with_counting_ranges(measured_table)
    hashes = {hash(measured_table) for _ in range(3)} | {hash(config) for _ in range(3)}
    assert len(hashes) == 2 and CountingRanges.calls == 0


def test_range_for_reads_one_range():
    measured_table = with_counting_ranges(table(many_ranges(64)))
    assert measured_table.range_for(77) == TokenRange(77, 78, Tier.OVERLAP)
    assert CountingRanges.calls == 1


def test_a_pickled_table_carries_its_fields_only_and_is_equal_after():
    measured_table = table(TWO_RANGES)
    copy = pickle.loads(pickle.dumps(measured_table))
    assert set(measured_table.__getstate__()) == {field.name for field in dataclasses.fields(SelectionTable)}
    assert copy == measured_table and hash(copy) == hash(measured_table)
