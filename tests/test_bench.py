"""The benchmark: k3_tail.tools.benchmark on small meshes, and `python -m k3_tail bench` in a fresh process.

Nothing here asserts that one tier is faster than another (times depend on the machine and its
load); the tests check that every measurement is there and its statistics are consistent.
"""

import csv
import io
import itertools
import json
import re
import subprocess
import sys

import pytest

from helpers import command_environment, installed, make_tp_mesh, needs_extra, once_per_session
from k3_tail import TailConfig, Tier
from k3_tail.cli import main
from k3_tail.cli.harness import ProgressBar
from k3_tail.tools.benchmark import (
    Measurement,
    Timing,
    check_tiers,
    default_token_counts,
    local_gemm_columns,
    measure_local_gemm,
    measure_tiers,
    token_ladder,
)

SMALL_CONFIG = TailConfig(hidden_size=48, latent_size=16)
SMALL_FLAGS = ["--hidden-size", "64", "--latent-size", "32"]
COLUMN_TIERS = ["native", "overlap", "column_parallel", "scatter_gather"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CLI_RUN_LIMIT_S = 300


def run_cli(*argv, timeout=CLI_RUN_LIMIT_S):
    environment = command_environment()
    return subprocess.run([sys.executable, "-m", "k3_tail", *map(str, argv)], capture_output=True, text=True,
                          env=environment, timeout=timeout, check=False)


def assert_consistent(timing, repeats):
    assert 0 < timing.min_s <= timing.q25_s <= timing.median_s <= timing.q75_s <= timing.max_s
    assert timing.repeats == repeats


# ---- k3_tail.tools.benchmark, in this process ----


@pytest.mark.parametrize("layout", ["column", "replicated"])
def test_measure_tiers_defaults_to_every_tier_the_layout_runs_compiled_here(layout):
    """On a CPU one_kernel's Pallas kernel runs interpreted: there is nothing of it to time."""
    measurements = measure_tiers(SMALL_CONFIG, make_tp_mesh(2), [3], weight_layout=layout, repeats=2)
    assert [m.tier for m in measurements] == [tier for tier in Tier if tier.supports(layout)
                                              and tier is not Tier.ONE_KERNEL]
    for m in measurements:
        assert (m.num_tokens, m.tp_size, m.weight_layout) == (3, 2, layout)
        assert_consistent(m.timing, repeats=2)


def test_an_interpreted_tier_is_timed_when_asked_for():
    measurements = measure_tiers(SMALL_CONFIG, make_tp_mesh(2), [3], tiers=["one_kernel"], repeats=1)
    assert [m.tier for m in measurements] == [Tier.ONE_KERNEL]


def test_measure_tiers_keeps_the_given_tiers_in_order_token_count_major():
    measurements = measure_tiers(SMALL_CONFIG, make_tp_mesh(2), [1, 3], tiers=["scatter_gather", Tier.NATIVE],
                                 repeats=1)
    assert [(m.num_tokens, m.tier) for m in measurements] == [
        (1, Tier.SCATTER_GATHER), (1, Tier.NATIVE), (3, Tier.SCATTER_GATHER), (3, Tier.NATIVE)
    ]


def test_measure_tiers_reports_each_measurement_as_it_starts():
    labels = []
    measure_tiers(SMALL_CONFIG, make_tp_mesh(2), [1, 3], tiers=["native"], repeats=1, on_progress=labels.append)
    assert labels == ["p=2 T=1 native", "p=2 T=3 native"]


@pytest.mark.parametrize("changes", [
    {"use_latent_norm": False}, {"has_shared_experts": False}, {"routed_output_is_reduced": True},
], ids=["no-norm", "no-shared", "reduced-routed"])
def test_measure_tiers_places_inputs_for_any_config(changes):
    config = TailConfig(hidden_size=48, latent_size=16, **changes)
    measurements = measure_tiers(config, make_tp_mesh(2), [3], tiers=["native", "column_parallel"], repeats=1)
    assert [m.tier for m in measurements] == [Tier.NATIVE, Tier.COLUMN_PARALLEL]


@pytest.mark.parametrize("tiers, layout, config, message", [
    (["one_shot"], "column", SMALL_CONFIG, r"tiers: one_shot needs the whole \[L, H\] kernel on every rank"),
    (["one_shot"], "replicated", TailConfig(48, 16, routed_output_is_reduced=True), "tiers: one_shot reduces"),
    (["native", "native"], "column", SMALL_CONFIG, "tiers: native is given twice"),
    (["fastest"], "column", SMALL_CONFIG, "tiers: expected a k3_tail.Tier"),
    ([], "column", SMALL_CONFIG, "tiers: expected at least one tier"),
])
def test_check_tiers_names_the_tier_that_cannot_run(tiers, layout, config, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        check_tiers(tiers, layout, config)


def test_measure_tiers_rejects_an_unrunnable_tier_before_running_anything():
    labels = []
    with pytest.raises(ValueError, match="^tiers: one_shot"):
        measure_tiers(SMALL_CONFIG, make_tp_mesh(2), [1], tiers=["native", "one_shot"], on_progress=labels.append)
    assert labels == []


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-device", "every-device"])
def test_measure_local_gemm_times_the_bare_projection(concurrent):
    timing = measure_local_gemm(SMALL_CONFIG, make_tp_mesh(2), 3, columns=24, repeats=3, concurrent=concurrent)
    assert_consistent(timing, repeats=3)


@pytest.mark.parametrize("layout, tier, columns", [
    ("column", Tier.NATIVE, 25), ("column", Tier.SCATTER_GATHER, 25),
    ("replicated", Tier.NATIVE, 99), ("replicated", Tier.OVERLAP, 99), ("replicated", Tier.ONE_SHOT, 99),
    ("replicated", Tier.COLUMN_PARALLEL, 25), ("replicated", Tier.SCATTER_GATHER, 25),
])
def test_local_gemm_columns_is_the_padded_block_or_all_of_h(layout, tier, columns):
    assert local_gemm_columns(tier, TailConfig(hidden_size=99, latent_size=16), 4, layout) == columns


def test_token_ladder_doubles_up_to_its_maximum():
    assert token_ladder() == tuple(2**k for k in range(14))
    assert token_ladder(100) == (1, 2, 4, 8, 16, 32, 64, 100)


def test_default_token_counts_stop_at_1024_on_cpu():
    assert default_token_counts("cpu")[-1] == 1024 and default_token_counts("gpu")[-1] == 8192


def test_timing_interpolates_quartiles_between_runs():
    assert Timing.of([3.0, 1.0, 2.0, 10.0]) == Timing(
        median_s=2.5, min_s=1.0, max_s=10.0, q25_s=1.75, q75_s=4.75, repeats=4
    )


def test_measurement_round_trips_through_its_dict_and_csv_strings():
    measurement = Measurement(Tier.ONE_SHOT, 16, 8, "replicated", Timing(2e-3, 1e-3, 4e-3, 1.5e-3, 3e-3, 5))
    assert measurement.to_dict()["tier"] == "one_shot"
    assert Measurement.from_dict(measurement.to_dict()) == measurement
    assert Measurement.from_dict({k: str(v) for k, v in measurement.to_dict().items()}) == measurement


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_writes_a_line_per_step_off_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(2, stream)
    bar.step("p=2 T=1 native")
    bar.step("p=2 T=1 overlap")
    bar.finish()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 3
    assert lines[1].startswith("[############------------] 1/2 ") and lines[1].endswith("p=2 T=1 overlap")


def test_progress_bar_redraws_one_line_on_a_terminal():
    stream = _Terminal()
    bar = ProgressBar(2, stream)
    bar.step("p=2 T=1 native")
    bar.finish()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.count("\n") == 1 and text.endswith("done\x1b[K\n")


# ---- the command line ----


def bench_error(argv, capsys):
    """Exit status and stderr of ``main(["bench", *argv])`` in this process (argparse errors exit)."""
    try:
        status = main(["bench", *SMALL_FLAGS, *argv])
    except SystemExit as exit_info:
        status = exit_info.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--tiers", "one_shot"], "--tiers: one_shot needs the whole [L, H] kernel on every rank"),
    (["--tiers", "native,native"], "--tiers: native is given twice"),
    (["--json", "-", "--csv", "-"], "--json - and --csv -: only one of them can go to stdout"),
    (["--csv", "/no/such/dir/bench.csv"], "--csv /no/such/dir/bench.csv: no such directory"),
    (["--tp-sizes", "16"], "--tp-sizes: 16 is more than the 8 devices"),
    (["--eps", "0"], "config: rms_norm_eps: expected a finite number > 0"),
    (["--tiers", "fastest"], "argument --tiers: expected tiers among native,"),
    (["--tokens", "1,0"], "argument --tokens: expected an integer >= 1, got '0'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
])
def test_bench_bad_arguments_exit_2_with_a_one_line_error(argv, message, capsys):
    status, error = bench_error(argv, capsys)
    assert status == 2
    error_lines = [line for line in error.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and error_lines[0].startswith(f"k3-tail bench: error: {message}")
    assert "Traceback" not in error


def test_bench_plot_without_matplotlib_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    status, error = bench_error(["--plot", str(tmp_path / "bench.png")], capsys)
    assert status == 2 and error == "k3-tail bench: error: --plot needs matplotlib: pip install 'k3_tail[plot]'\n"


# The plot needs matplotlib (the [plot] extra): the shared run draws it where that is installed.
PLOT_INSTALLED = installed("matplotlib")
needs_plot = needs_extra("plot", "matplotlib")


@pytest.fixture(scope="session")
def bench_run(tmp_path_factory):
    """One small `bench` run (p in {2, 4} x T in {1, 8} x the column layout's tiers) with every output (the plot
    where matplotlib is installed), once per session (also under xdist)."""

    def run(directory):
        paths = {name: directory / f"bench.{name}" for name in ("json", "csv", "png")}
        plot = ["--plot", paths["png"]] if PLOT_INSTALLED else []
        completed = run_cli("bench", *SMALL_FLAGS, "--tokens", "1,8", "--repeats", "2", "--tp-sizes", "2,4",
                            "--json", paths["json"], "--csv", paths["csv"], *plot, timeout=CLI_RUN_LIMIT_S)
        return {"returncode": completed.returncode, "stdout": completed.stdout, "stderr": completed.stderr}

    directory, outcome = once_per_session(tmp_path_factory, "bench-cli", run, timeout_s=CLI_RUN_LIMIT_S + 30)
    result = subprocess.CompletedProcess("bench", **outcome)
    assert result.returncode == 0, result.stderr
    return result, {name: directory / f"bench.{name}" for name in ("json", "csv", "png")}


EXPECTED_ROWS = {(p, t, tier) for p, t, tier in itertools.product((2, 4), (1, 8), COLUMN_TIERS)}


def test_bench_table_has_a_row_per_p_t_and_tier(bench_run):
    result, _ = bench_run
    assert "config: H=64, L=32, bfloat16" in result.stdout and "not run: one_shot" in result.stdout
    # Rows: p, T, tier, median ms, q25-q75 ms, speedup vs native, maybe "*".
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s*\d+\s+\d+\s", line)]
    assert {(int(row[0]), int(row[1]), row[2]) for row in rows} == EXPECTED_ROWS
    assert all(row[5] == "1.00x" for row in rows if row[2] == "native")
    selected = [(int(row[0]), int(row[1])) for row in rows if row[-1] == "*"]
    assert sorted(selected) == sorted({(p, t) for p, t, _ in EXPECTED_ROWS})  # select_tier's pick, once per (p, T)


def test_bench_table_marks_the_fastest_tier_and_says_how_far_the_selection_is(bench_run):
    result, _ = bench_run
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\s*\d+\s+\d+\s", line)]
    fastest = [(int(row[0]), int(row[1])) for row in rows if row[6] == "fastest"]
    assert sorted(fastest) == sorted({(p, t) for p, t, _ in EXPECTED_ROWS})  # one per (p, T)
    assert all(re.fullmatch(r"\+[\d.]+%", row[6]) for row in rows if row[6] != "fastest")
    gaps = re.findall(r"^\s*p=(\d+) T=(\d+): selected \w+(?:, the fastest|, fastest \w+: selection [\d.]+% slower)",
                      result.stdout, flags=re.MULTILINE)
    assert sorted((int(p), int(t)) for p, t in gaps) == sorted(fastest)


def test_bench_json_has_every_measurement_with_consistent_statistics(bench_run):
    document = json.loads(bench_run[1]["json"].read_text())
    assert document["config"]["hidden_size"] == 64 and document["machine"]["device_count"] == 8
    assert document["settings"]["tp_sizes"] == [2, 4] and document["settings"]["weight_layout"] == "column"
    measurements = [Measurement.from_dict(row) for row in document["measurements"]]
    assert {(m.tp_size, m.num_tokens, m.tier.value) for m in measurements} == EXPECTED_ROWS
    for m in measurements:
        assert_consistent(m.timing, repeats=2)


def test_bench_csv_holds_the_json_measurements(bench_run):
    paths = bench_run[1]
    with paths["csv"].open(newline="") as stream:
        from_csv = [Measurement.from_dict(row) for row in csv.DictReader(stream)]
    from_json = [Measurement.from_dict(row) for row in json.loads(paths["json"].read_text())["measurements"]]
    assert from_csv == from_json and len(from_csv) == len(EXPECTED_ROWS)


@needs_plot
def test_bench_plot_is_a_png(bench_run):
    assert bench_run[1]["png"].read_bytes().startswith(PNG_SIGNATURE)


def test_bench_progress_off_a_terminal_is_one_line_per_step(bench_run):
    result, _ = bench_run
    progress = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == len(EXPECTED_ROWS) + 1 and progress[-1].startswith("[" + "#" * 24 + "] 16/16 ")
    assert "\r" not in result.stderr and "Traceback" not in result.stderr


def test_bench_json_to_stdout_leaves_the_table_to_stderr(capsys):
    assert main(["bench", *SMALL_FLAGS, "--tokens", "4", "--repeats", "1", "--tp-sizes", "2",
                 "--weight-layout", "replicated", "--tiers", "native,one_shot", "--json", "-"]) == 0
    output = capsys.readouterr()
    document = json.loads(output.out)
    assert [(m["tier"], m["weight_layout"]) for m in document["measurements"]] == [
        ("native", "replicated"), ("one_shot", "replicated")
    ]
    assert "median ms" in output.err


# ---- the plot, drawn from synthetic measurements (no timing run) ----

PLOT_TIERS = (Tier.NATIVE, Tier.OVERLAP, Tier.COLUMN_PARALLEL)
PLOT_TOKENS = (1, 4, 16)
# As long as bench's title of a config with every flag on: it has to break into lines to fit.
LONG_TITLE = ("H=7168, L=3584, bfloat16, eps 1e-05, scale 2.827, sequence-parallel, up projection float8_e4m3fn, "
              "FP8 activations, int4-quantised sums (vLLM's minimum); kernel column; cpu")


def synthetic_measurements(tp_sizes):
    """A tier's median at (p, T): distinct for every point, so a ring's position names its tier."""
    def timing(median_s):
        return Timing(median_s, 0.8 * median_s, 1.3 * median_s, 0.9 * median_s, 1.1 * median_s, 5)

    return [Measurement(tier, t, p, "column", timing(1e-3 * (index + 1) * t / p))
            for p in tp_sizes for t in PLOT_TOKENS for index, tier in enumerate(PLOT_TIERS)]


@needs_plot
@pytest.mark.parametrize("tp_sizes", [(8,), (2, 4, 8)], ids=["one-tp-size", "three-tp-sizes"])
@pytest.mark.parametrize("title", ["H=7168, L=3584, bfloat16, eps 1e-05, scale 2.827; kernel column; cpu", LONG_TITLE],
                         ids=["bench-title", "long-title"])
def test_bench_plot_has_the_whole_title_the_band_and_the_selection_in_its_legend(tp_sizes, title):
    from matplotlib.text import Text

    from k3_tail.tools import plotting

    selected = {(p, t, "column"): Tier.OVERLAP if t < 16 else Tier.COLUMN_PARALLEL
                for p in tp_sizes for t in PLOT_TOKENS}
    figure = plotting.measurement_figure(synthetic_measurements(tp_sizes), title=title, selected=selected)
    figure.canvas.draw()
    canvas = figure.bbox
    suptitle = figure.get_suptitle()
    (title_text,) = [text for text in figure.findobj(Text) if text.get_text() == suptitle]
    title_box = title_text.get_window_extent()
    (legend,) = figure.legends
    assert " ".join(suptitle.split()) == title
    assert canvas.x0 <= title_box.x0 and title_box.x1 <= canvas.x1 and title_box.y1 <= canvas.y1
    assert not title_box.overlaps(legend.get_window_extent())
    assert [text.get_text() for text in legend.get_texts()] == [
        *(tier.value for tier in PLOT_TIERS), plotting.BAND_LABEL, plotting.SELECTED_LABEL]
    axes = figure.get_axes()
    assert [axis.get_title() for axis in axes] == [f"p = {p}" for p in tp_sizes]
    for axis, p in zip(axes, tp_sizes, strict=True):
        (rings,) = [line for line in axis.get_lines() if line.get_gid() == plotting.SELECTED_GID]
        medians = {(m.num_tokens, m.tier): 1e3 * m.timing.median_s for m in synthetic_measurements([p])}
        assert list(zip(*rings.get_data(), strict=True)) == [(t, medians[t, selected[p, t, "column"]])
                                                             for t in PLOT_TOKENS]


@needs_plot
def test_bench_plot_without_a_selection_has_no_rings():
    from k3_tail.tools import plotting

    figure = plotting.measurement_figure(synthetic_measurements([2]))
    (legend,) = figure.legends
    assert plotting.SELECTED_LABEL not in [text.get_text() for text in legend.get_texts()]
    assert not [line for line in figure.get_axes()[0].get_lines() if line.get_gid() == plotting.SELECTED_GID]


@needs_plot
def test_plot_measurements_writes_a_png_to_a_file_object():
    from k3_tail.tools import plotting

    buffer = io.BytesIO()
    plotting.plot_measurements(synthetic_measurements([2]), buffer, title="two ranks")
    assert buffer.getvalue().startswith(PNG_SIGNATURE)
