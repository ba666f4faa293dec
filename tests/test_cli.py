"""The command line: `python -m k3_tail demo` in a fresh process, as a user runs it."""

import json
import operator
import os
import subprocess
import sys

import jax
import pytest

from helpers import command_environment, needs_extra
from k3_tail.cli import CLOSED_PIPE_STATUS, COMMANDS, build_parser, calibrate, demo, hlo, main
from k3_tail.cli.harness import MAX_CPU_DEVICES, all_reduce_quantization_options, up_projection_options
from k3_tail.cli.measurement import measurement_config
from k3_tail.cli.tables import describe_config, format_selection_gap, format_table
from k3_tail.config import TailConfig
from k3_tail.selection.rules import gpu_rules_note, select_tier
from k3_tail.tiers.registry import TIER_RECORDS, Tier, tier_table
from k3_tail.tools.benchmark import Measurement, Timing
from k3_tail.units import format_bytes, format_flops, format_seconds


def test_demo_builds_its_own_mesh_and_all_tiers_agree_with_native():
    environment = command_environment()
    result = subprocess.run(
        [sys.executable, "-m", "k3_tail", "demo", "--tokens", "2,257", "--repeats", "1"],
        capture_output=True, text=True, env=environment, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "8 devices" in result.stdout and "H=7168, L=3584" in result.stdout
    table = result.stdout.splitlines()
    for tier in ("native", "overlap", "column_parallel", "scatter_gather"):
        assert sum(f"  {tier} " in line for line in table) == 2
    assert "<- T=2 <= overlap_token_threshold=256" in result.stdout
    assert "<- T=257 > overlap_token_threshold=256" in result.stdout
    assert "every tier agrees with native" in result.stdout
    assert "Traceback" not in result.stderr
    assert "T=257 (2/2) scatter_gather" in result.stderr  # progress while it works
    # On the CPU mesh: once, before the table, that the rules are GPU thresholds and how to calibrate.
    assert f"selection: {gpu_rules_note(TailConfig.kimi_k3(), 'cpu')}" in table
    assert result.stdout.count("vLLM's GPU thresholds") == 1


@pytest.mark.parametrize("argv", [["demo", "--tokens", "0"], ["demo", "--repeats", "x"], ["frobnicate"], []])
def test_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: k3-tail" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["demo"], ["bench"], ["calibrate"], ["hlo", "--topology", "cpu"]],
                         ids=lambda command: command[0])
def test_more_cpu_devices_than_the_maximum_is_a_usage_error_naming_devices(command, capsys):
    """Refused at parsing: JAX would spend minutes, silently, building 100000 CPU devices."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--devices", "100000"])
    assert exit_info.value.code == 2
    assert f"argument --devices: expected at most {MAX_CPU_DEVICES} CPU devices, got 100000" in capsys.readouterr().err


@pytest.mark.parametrize(("command", "seed"), [("demo", "-1"), ("demo", str(2**32)), ("bench", "-1"),
                                               ("calibrate", "-1")])
def test_a_seed_numpy_cannot_take_is_a_usage_error_naming_seed(command, seed, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--seed", seed])
    assert exit_info.value.code == 2
    assert f"argument --seed: expected an integer in [0, 2**32), got '{seed}'" in capsys.readouterr().err


def test_the_largest_device_count_and_the_extreme_seeds_parse():
    assert build_parser().parse_args(["demo", "--devices", str(MAX_CPU_DEVICES)]).devices == MAX_CPU_DEVICES
    seeds = [build_parser().parse_args(["demo", "--seed", seed]).seed for seed in ("0", str(2**32 - 1))]
    assert seeds == [0, 2**32 - 1]


def run_cli(*argv):
    environment = command_environment()
    return subprocess.run([sys.executable, "-m", "k3_tail", *argv], capture_output=True, text=True, env=environment,
                          timeout=600, check=False)


@needs_extra("aot", "jax_plugins.xla_cuda13")
def test_hlo_shows_the_overlap_tier_overlapped_on_eight_h100s_reading_its_fp8_kernel():
    result = run_cli("hlo", "--tier", "overlap", "--tokens", "16", "--topology", "h100x8",
                     "--up-proj-dtype", "float8_e4m3fn")
    assert result.returncode == 0, result.stderr
    assert "overlapped: True" in result.stdout and "NVIDIA H100" in result.stdout
    assert "up projection float8_e4m3fn" in result.stdout
    gemm_lines = [line for line in result.stdout.splitlines() if "FLOP, reads" in line]
    assert gemm_lines and all("f8e4m3fn[" in line for line in gemm_lines)
    assert "Traceback" not in result.stderr and "cuDNN" not in result.stderr


@pytest.mark.parametrize("command", ["demo", "bench", "hlo", "calibrate"])
def test_every_command_that_runs_the_tail_takes_the_fp8_flags(command):
    extra = ["--out", "table.json"] if command == "calibrate" else []
    args = build_parser().parse_args([command, *extra, "--up-proj-dtype", "float8_e4m3fnuz", "--fp8-activations"])
    assert up_projection_options(args) == {"up_proj_dtype": "float8_e4m3fnuz", "fp8_activations": True}
    if command in ("bench", "calibrate"):
        config = measurement_config(args)
        assert config.up_proj_dtype.name == "float8_e4m3fnuz" and config.fp8_activations


def test_fp8_activations_without_an_fp8_kernel_is_a_one_line_error(capsys):
    assert main(["hlo", "--topology", "cpu", "--fp8-activations"]) == 2
    assert capsys.readouterr().err.startswith("k3-tail hlo: error: --fp8-activations: needs --up-proj-dtype")


@pytest.mark.parametrize("command", ["demo", "bench", "hlo", "calibrate"])
def test_every_command_that_runs_the_tail_takes_the_all_reduce_quantization_flags(command):
    extra = ["--out", "table.json"] if command == "calibrate" else []
    args = build_parser().parse_args([command, *extra, "--all-reduce-quantization", "int6",
                                      "--quantized-all-reduce-min-bytes", "4096"])
    # hlo takes lists of each (a sweep): here one codec and one minimum, so one way for the sums to travel.
    options = hlo.sum_options(args)[0] if command == "hlo" else all_reduce_quantization_options(args)
    assert options == {"all_reduce_quantization": "int6", "quantized_all_reduce_min_bytes": 4096}
    config = measurement_config(args) if command in ("bench", "calibrate") else TailConfig.kimi_k3(**options)
    assert config.all_reduce_quantization == "int6" and config.quantized_all_reduce_min_bytes == 4096


def test_all_reduce_quantization_defaults_to_none_with_vllms_minimum():
    args = build_parser().parse_args(["bench"])
    assert all_reduce_quantization_options(args) == {"all_reduce_quantization": None,
                                                     "quantized_all_reduce_min_bytes": None}


def test_quantized_all_reduce_min_bytes_without_a_codec_is_a_one_line_error(capsys):
    assert main(["hlo", "--topology", "cpu", "--quantized-all-reduce-min-bytes", "0"]) == 2
    assert capsys.readouterr().err.startswith(
        "k3-tail hlo: error: --quantized-all-reduce-min-bytes: needs --all-reduce-quantization")


def test_an_unknown_all_reduce_quantization_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--all-reduce-quantization", "fp8"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_describe_config_names_the_codec_and_its_minimum():
    assert describe_config(TailConfig.kimi_k3(all_reduce_quantization="int4", quantized_all_reduce_min_bytes=0)
                           ).endswith(", int4-quantised sums >= 0 B")
    assert describe_config(TailConfig.kimi_k3(all_reduce_quantization="int8")
                           ).endswith(", int8-quantised sums (vLLM's minimum)")
    assert "quantised" not in describe_config(TailConfig.kimi_k3())


def test_hlo_compiles_the_quantised_sums_on_a_cpu_mesh(capsys):
    assert main(["hlo", "--topology", "cpu", "--devices", "4", "--tokens", "16",
                 "--all-reduce-quantization", "int4", "--quantized-all-reduce-min-bytes", "0"]) == 0
    output = capsys.readouterr().out
    assert "int4-quantised sums >= 0 B" in output
    assert "int4-quantised all-to-all" in output


def test_hlo_json_on_a_cpu_mesh_names_the_selected_tier(capsys):
    assert main(["hlo", "--topology", "cpu", "--devices", "4", "--tokens", "300", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tier"] == "column_parallel" and "overlap_token_threshold" in data["tier_reason"]
    assert data["tp_size"] == 4 and data["report"]["platform"] == "cpu"


def test_hlo_unknown_topology_is_a_one_line_error(capsys):
    assert main(["hlo", "--topology", "a100x8"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("k3-tail hlo: error: --topology") and error.count("\n") == 1


def test_tiers_markdown_prints_the_registry_tier_table(capsys):
    assert main(["tiers", "--markdown"]) == 0
    assert capsys.readouterr().out == tier_table() + "\n"


def test_tiers_json_lists_every_tier_record_as_plain_data(capsys):
    assert main(["tiers", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [record["name"] for record in records] == [tier.value for tier in Tier]
    for record in records:
        tier = Tier.parse(record["name"])
        assert record["summary"] == tier.record.prose.summary and record["schedule"] == tier.record.prose.schedule
        assert record["needs_whole_kernel"] == tier.record.needs_whole_kernel
        assert record["compiler_options"] == {family: dict(options)
                                              for family, options in tier.record.compiler_options.items()}
    assert set(records[0]) == {
        "name", "summary", "schedule", "collectives_text", "needs_whole_kernel", "serves_routed_output_is_reduced",
        "projects_all_columns", "token_sharded_form", "shared_reduced_form", "compiler_options",
    }


@pytest.mark.parametrize("command", ["hlo", "bench", "calibrate"])
def test_tier_flags_help_names_every_registered_tier(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for tier in Tier:
        assert tier.value in text


# ---- what the output says: the fastest tier, noise, extrapolation, units, widths ----


def timing(median_s, spread_s=0.0):
    """A Timing of ``median_s`` whose q25-q75 range is ``median_s`` +- ``spread_s``."""
    return Timing(median_s=median_s, min_s=median_s - 2 * spread_s, max_s=median_s + 2 * spread_s,
                  q25_s=median_s - spread_s, q75_s=median_s + spread_s, repeats=5)


def test_format_bytes_scales_to_the_figure():
    assert [format_bytes(count) for count in (512, 12.3 * 2**10, 6.13 * 2**20, 1.5 * 2**30)] == [
        "512 B", "12.3 KiB", "6.13 MiB", "1.50 GiB"]


def test_format_flops_scales_to_the_figure():
    assert [format_flops(count) for count in (512, 822e6, 13.15e9)] == ["512 FLOP", "822 MFLOP", "13.2 GFLOP"]


def test_format_seconds_scales_to_the_figure():
    assert [format_seconds(seconds) for seconds in (812e-6, 1.234e-3, 2.5)] == ["812 us", "1.23 ms", "2.50 s"]


def test_the_selection_gap_says_how_much_slower_the_selected_tier_is():
    gap = format_selection_gap(Tier.NATIVE, {Tier.NATIVE: timing(1.25e-3), Tier.OVERLAP: timing(1e-3)})
    assert gap == "selected native, fastest overlap: selection 25% slower (1.25 ms vs 1.00 ms)"


def test_the_selection_gap_says_when_the_two_are_within_noise():
    gap = format_selection_gap(Tier.NATIVE, {Tier.NATIVE: timing(1.05e-3, 1e-4), Tier.OVERLAP: timing(1e-3, 1e-4)})
    assert gap.endswith("within noise: their q25-q75 ranges overlap)")


def test_the_selection_gap_of_the_fastest_tier_says_so():
    assert format_selection_gap(Tier.OVERLAP, {Tier.NATIVE: timing(2e-3), Tier.OVERLAP: timing(1e-3)}) == (
        "selected overlap, the fastest")


def test_bench_on_the_cpu_says_once_that_its_selection_is_gpu_thresholds_and_how_to_calibrate(capsys):
    assert main(["bench", "--tokens", "1,2", "--tiers", "native", "--repeats", "1", "--tp-sizes", "2",
                 "--hidden-size", "16", "--latent-size", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    note = gpu_rules_note(TailConfig.kimi_k3(), "cpu")  # the rules' note, whatever the shapes
    assert [line for line in lines if "GPU thresholds" in line] == [f"selection (*): {note}"]


def test_demo_table_marks_the_fastest_tier_beside_the_selected_one(capsys):
    selection = select_tier(TailConfig.kimi_k3(), 16, 8, weight_layout="column", device_kind="cpu")
    other = Tier.NATIVE if selection.tier != Tier.NATIVE else Tier.OVERLAP
    rows = [demo.TierRow(16, tier, selection, 0.0, 0.0, timing(seconds))
            for tier, seconds in ((selection.tier, 1.1e-3), (other, 1e-3))]
    demo.print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in lines if f"  {other.value} " in line] == ["fastest"]
    selected_row, = (line for line in lines if f"  {selection.tier.value} " in line)
    assert "+10%" in selected_row and f"<- {selection.reason}" in selected_row
    assert lines[-1].strip() == (f"T=16: selected {selection.tier.value}, fastest {other.value}: selection 10% slower "
                                 "(1.10 ms vs 1.00 ms)")


def measurements_at(num_tokens, *timings):
    return [Measurement(tier, num_tokens, 2, "column", tier_timing) for tier, tier_timing in timings]


def test_calibrate_warns_when_the_winner_is_within_the_noise():
    warnings = calibrate.noise_warnings([
        *measurements_at(1, (Tier.NATIVE, timing(1e-3)), (Tier.OVERLAP, timing(2e-3))),
        *measurements_at(8, (Tier.NATIVE, timing(1.02e-3, 1e-4)), (Tier.OVERLAP, timing(1e-3, 1e-4))),
    ])
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: T=8: overlap wins by 2.0% (1.00 ms vs native's 1.02 ms), within the noise")


def test_calibrate_does_not_warn_when_the_winner_is_clear():
    assert calibrate.noise_warnings(
        measurements_at(8, (Tier.NATIVE, timing(1.2e-3, 1e-5)), (Tier.OVERLAP, timing(1e-3, 1e-5)))) == []


def test_calibrate_says_the_last_range_is_extrapolated(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "table.json"), "--tokens", "1,4", "--hidden-size", "64",
                 "--latent-size", "32", "--repeats", "1", "--tp-size", "2", "--tiers", "native,overlap"]) == 0
    assert "T > 4 is extrapolated: no larger T was measured" in capsys.readouterr().out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="this host has accelerators")
def test_hlo_local_topology_without_accelerators_is_a_one_line_error(capsys):
    assert main(["hlo", "--topology", "local"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("k3-tail hlo: error: --topology local: this machine has no accelerators")
    assert error.count("\n") == 1


@pytest.mark.parametrize("width", [60, 100, 200])
def test_tiers_table_fits_the_terminal_width(width, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(width))
    assert main(["tiers"]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) <= width


@pytest.mark.parametrize("width", [80, 140], ids=["blocks", "table"])
def test_tiers_table_wraps_long_cells_keeping_every_word(width, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(width))
    assert main(["tiers"]) == 0
    words = capsys.readouterr().out.split()
    for record in TIER_RECORDS:
        assert all(word in words for word in record.prose.summary.split())


def test_tiers_prints_a_plain_table_not_markdown_by_default(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["tiers"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "tier" and not any(line.startswith("|") for line in lines)


def test_format_table_right_aligns_figures_and_wraps_only_text():
    columns = [("name", "<", operator.itemgetter(0)), ("bytes", ">", operator.itemgetter(1))]
    table = format_table([["a long name to wrap", "12.3 MiB"], ["b", "512 B"]], columns, fit=True, width=20)
    assert table.splitlines() == ["name" + " " * 11 + "bytes", "-" * 10 + "  " + "-" * 8, "a long      12.3 MiB",
                                  "name to", "wrap", "", "b" + " " * 14 + "512 B"]


def test_format_table_too_wide_for_the_terminal_prints_a_block_per_row():
    columns = [("tier", "<", operator.itemgetter(0)), ("schedule", "<", operator.itemgetter(1))]
    table = format_table([["overlap", "AR(r) + norm; AR(s) started; GEMM"]], columns, fit=True, width=12)
    assert table.splitlines() == ["overlap", "  schedule:", "    AR(r) +", "    norm;", "    AR(s)", "    started;",
                                  "    GEMM"]


def test_format_table_refuses_a_width_for_a_table_its_specs_lay_out():
    with pytest.raises(ValueError, match="^width: "):
        format_table([["a"]], [("name", "<8", operator.itemgetter(0))], width=20)


def hlo_rows(capsys, *argv):
    """The document of an ``hlo`` sweep on 2 CPU devices (its --json), run in this process."""
    assert main(["hlo", "--topology", "cpu", "--devices", "2", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hlo_sweeps_the_cross_product_of_token_counts_and_tiers(capsys):
    rows = hlo_rows(capsys, "--tokens", "1,2", "--tier", "native,overlap")["rows"]
    assert [(row["num_tokens"], row["tier"]) for row in rows] == [(1, "native"), (1, "overlap"), (2, "native"),
                                                                  (2, "overlap")]
    assert all(row["accessed_vs_baseline_tokens"] == 1.0 for row in rows if row["num_tokens"] == 2)


def test_hlo_sweep_of_all_tiers_leaves_out_those_the_layout_cannot_run(capsys):
    document = hlo_rows(capsys, "--tokens", "1", "--tier", "all", "--weight-layout", "column,replicated")
    column = {row["tier"] for row in document["rows"] if row["weight_layout"] == "column"}
    replicated = {row["tier"] for row in document["rows"] if row["weight_layout"] == "replicated"}
    assert column == {tier.value for tier in Tier if tier.supports("column")} and len(replicated) == len(Tier)
    assert document["left_out"] == [f"{tier.value} with the column layout, because {tier.why_not('column')}"
                                    for tier in Tier if not tier.supports("column")]


def test_hlo_sweep_of_kernel_variants_holds_half_the_kernel_in_fp8(capsys):
    rows = hlo_rows(capsys, "--tokens", "1", "--tier", "native", "--kernels", "bf16,fp8,fp8+act")["rows"]
    bf16, fp8, fp8_act = rows
    assert (fp8["up_proj_dtype"], fp8_act["fp8_activations"]) == ("float8_e4m3fn", True)
    assert fp8["kernel_bytes"] < 0.6 * bf16["kernel_bytes"] and fp8_act["kernel_bytes"] == fp8["kernel_bytes"]


def test_hlo_sweep_of_quantised_sums_compiles_unquantised_once_and_each_codec_at_each_minimum(capsys):
    rows = hlo_rows(capsys, "--tokens", "16", "--tier", "native", "--all-reduce-quantization", "none,int4",
                    "--quantized-all-reduce-min-bytes", "0,vllm")["rows"]
    assert [row["sums"] for row in rows] == ["unquantised", "int4, every sum", "int4, vLLM minimum"]
    assert rows[0]["wire_vs_unquantised"] == 1.0 and rows[1]["wire_vs_unquantised"] < 0.5
    assert any(form.startswith("int4-quantised all-to-all") for form in rows[1]["collectives"])


def test_hlo_table_scales_its_units_and_says_the_constant_labels_once(capsys):
    assert main(["hlo", "--topology", "cpu", "--devices", "2", "--tokens", "1", "--tier", "native",
                 "--columns", "accessed,kernel_held,wire"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "topology cpu; T 1; layout column; kernel bf16; sums unquantised" in lines
    header = lines.index(next(line for line in lines if line.startswith("tier")))
    assert lines[header].split() == ["tier", "accessed", "kernel", "held", "wire"]
    row = lines[header + 2].split()
    assert row[0] == "native" and row[2] == "MiB" and row[4] == "MiB" and row[6] in ("B", "KiB")


def test_hlo_markdown_prints_the_table_as_markdown(capsys):
    assert main(["hlo", "--topology", "cpu", "--devices", "2", "--tokens", "1,2", "--tier", "native",
                 "--markdown"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert table[0] == "| T | tier | accessed | temp | GEMMs | GPU kernels | wire | overlapped |"
    assert table[1] == "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |" and len(table) == 4


def test_hlo_help_explains_every_column(capsys):
    with pytest.raises(SystemExit):
        main(["hlo", "--help"])
    text = capsys.readouterr().out
    for name, column in hlo.COLUMNS.items():
        assert f"  {name} " in text and column.label.format(baseline="N") in text
    assert "B, KiB, MiB, GiB" in text


def test_a_command_whose_reader_closes_the_pipe_ends_quietly_with_status_141():
    """As `k3-tail tiers --json | head -1`, the reader gone before the command writes (it is still importing):
    no BrokenPipeError from the command or from the interpreter's flush at exit, and 141, as `git log | head`."""
    process = subprocess.Popen([sys.executable, "-m", "k3_tail", "tiers", "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=command_environment())
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr) == (CLOSED_PIPE_STATUS, b"")


class ClosedPipe:
    """A stdout whose reader is gone: every write and flush raises BrokenPipeError; its file descriptor is a
    real one, which the command points at /dev/null."""

    def __init__(self, fd):
        self.fd = fd

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        return self.fd

    def isatty(self):
        return False


@pytest.mark.parametrize("argv", [["tiers"], ["hlo", "--help"]], ids=" ".join)
def test_a_closed_stdout_is_pointed_at_devnull_after_a_command_or_its_help(argv, tmp_path, monkeypatch):
    with open(tmp_path / "stdout", "w") as stand_in:
        monkeypatch.setattr(sys, "stdout", ClosedPipe(stand_in.fileno()))
        assert main(argv) == CLOSED_PIPE_STATUS  # --help's SystemExit too: the flush after it meets the pipe
        assert os.path.samestat(os.fstat(stand_in.fileno()), os.stat(os.devnull))


def help_text(argv, capsys):
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("command", [[], *([name] for name in COMMANDS)], ids=lambda argv: " ".join(argv) or "k3-tail")
def test_help_is_wrapped_to_an_80_column_terminal(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    lines = help_text(command, capsys).splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)


def test_hlo_help_keeps_a_label_per_line_and_wraps_its_text_under_the_text(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    lines = help_text(["hlo"], capsys).splitlines()
    start = lines.index(next(line for line in lines if line.startswith("  accessed ")))
    label_column = " " * (hlo.EPILOG_LABEL_WIDTH + 2)
    assert lines[start + 1].startswith(label_column) and lines[start + 1][len(label_column)] != " "
    assert lines[start + 4] == "  vs_tokens (x T=N)" and lines[start + 5].startswith(label_column + "accessed")
