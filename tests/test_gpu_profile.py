"""scripts/gpu_profile.py on the CPU, at tiny shapes: once in a fresh process, once in this one.

The script is meant for a GPU host; here it runs on the CPU backend (no JAX_PLATFORMS and no forced
device count, as a user would start it; compiled fast: helpers.command_environment), and the tests
check what it reports, not how fast anything is. The second run, of other flags, calls its main here (it
profiles one device: this process's first CPU device), without a second interpreter's start-up.
The GEMM shapes are worked out here by hand, not from the tier records the script reads.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import command_environment, once_per_session, script_module
from k3_tail import Tier
from k3_tail.hardware import HARDWARE
from lab.blocks import WEIGHT_LAYOUTS

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_profile.py"
HIDDEN, LATENT, ITEM_BYTES = 64, 32, 2  # bfloat16
TOKENS, TP_SIZES = (1, 8), (2, 4)
RUN_LIMIT_S = 120
# On the CPU one_kernel's Pallas kernel runs interpreted: the script times only the tiers compiled there.
COMPILED_HERE = [tier for tier in Tier if not tier.record.runs_interpreted_on("cpu")]


def run_script(*argv):
    environment = command_environment()
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, text=True,
                          env=environment, timeout=RUN_LIMIT_S, check=False)


def small_flags(tokens=TOKENS, tp_sizes=TP_SIZES):
    return ["--hidden-size", HIDDEN, "--latent-size", LATENT, "--tokens", ",".join(map(str, tokens)),
            "--tp-sizes", ",".join(map(str, tp_sizes)), "--repeats", 1]


def assert_consistent(row, repeats):
    assert 0 < row["min_s"] <= row["q25_s"] <= row["median_s"] <= row["q75_s"] <= row["max_s"]
    assert row["repeats"] == repeats
    assert math.isclose(row["tflops_per_s"], row["gemm_flops"] / row["median_s"] / 1e12)
    assert math.isclose(row["gb_per_s"], row["bytes_moved"] / row["median_s"] / 1e9)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """(stdout, JSON report) of the fresh process's run, once per session (pytest-xdist workers share it)."""
    def run(directory):
        path = directory / "profile.json"
        result = run_script(*small_flags(), "--hardware", "h200", "--json", path)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        return {"stdout": result.stdout, "report": json.loads(path.read_text())}

    _, outcome = once_per_session(tmp_path_factory, "gpu_profile", run, timeout_s=RUN_LIMIT_S)
    return outcome["stdout"], outcome["report"]


def test_one_row_per_tier_layout_tp_size_and_token_count(profile):
    stdout, report = profile
    keys = [(row["tier"], row["weight_layout"], row["tp_size"], row["num_tokens"]) for row in report["rows"]]
    expected = {(tier.value, layout, p, tokens) for tier in COMPILED_HERE for layout in WEIGHT_LAYOUTS
                if tier.supports(layout) for p in TP_SIZES for tokens in TOKENS}
    assert len(keys) == len(set(keys)) and set(keys) == expected
    assert {row["tier"] for row in report["rows"]} == {tier.value for tier in COMPILED_HERE}
    for row in report["rows"]:
        assert_consistent(row, repeats=1)
        assert f"{row['tier']:<16}{row['weight_layout']:<11}" in stdout
    assert report["settings"]["tp_sizes"] == list(TP_SIZES) and report["settings"]["tokens"] == list(TOKENS)
    assert report["config"]["hidden_size"] == HIDDEN and report["config"]["latent_size"] == LATENT
    assert report["machine"]["backend"] == "cpu"


@pytest.mark.parametrize(("tier", "layout", "p", "tokens", "rows", "columns"), [
    ("token_parallel", "replicated", 4, 8, 2, HIDDEN),  # its own T/p rows, all columns
    ("token_parallel", "replicated", 4, 1, 1, HIDDEN),  # T = 1 padded to p = 4 rows: one per rank
    ("column_parallel", "column", 4, 8, 8, HIDDEN // 4),  # all rows, its column block
    ("column_parallel", "replicated", 2, 1, 1, HIDDEN // 2),  # the block sliced out of the whole kernel
    ("native", "replicated", 2, 8, 8, HIDDEN),
    ("native", "column", 4, 8, 8, HIDDEN // 4),
])
def test_gemm_flops_and_bytes_follow_the_rank_s_shapes(profile, tier, layout, p, tokens, rows, columns):
    _, report = profile
    [row] = [row for row in report["rows"]
             if (row["tier"], row["weight_layout"], row["tp_size"], row["num_tokens"]) == (tier, layout, p, tokens)]
    assert (row["gemm_rows"], row["gemm_columns"]) == (rows, columns)
    assert row["gemm_flops"] == 2 * rows * LATENT * columns
    # latent [rows, L], norm weight [L], kernel [L, columns], shared [rows, columns] in; [rows, columns] out.
    elements = rows * LATENT + LATENT + LATENT * columns + 2 * rows * columns
    assert row["bytes_moved"] == ITEM_BYTES * elements
    h200 = HARDWARE["h200"]
    assert math.isclose(row["peak_flops_fraction"], row["gemm_flops"] / row["median_s"] / h200.peak_flops)
    assert math.isclose(row["hbm_bandwidth_fraction"], row["bytes_moved"] / row["median_s"] / h200.hbm_bytes_per_s)


def test_the_report_says_the_cpu_fractions_are_meaningless(profile):
    stdout, report = profile
    assert report["hardware"]["name"] == "h200"
    assert "meaningless" in report["hardware_note"] and "meaningless" in stdout
    assert report["dispatch_floor"]["median_s"] > 0


def test_json_to_stdout_puts_the_table_on_stderr_and_no_preset_means_no_fractions(capsys):
    flags = [*map(str, small_flags(tokens=(3,), tp_sizes=(2,))), "--weight-layout", "replicated", "--json", "-"]
    assert script_module(SCRIPT).main(flags) == 0
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    assert report["hardware"] is None
    rows = report["rows"]
    assert [row["tier"] for row in rows] == [tier.value for tier in COMPILED_HERE if tier.supports("replicated")]
    assert all(row["peak_flops_fraction"] is None and row["hbm_bandwidth_fraction"] is None for row in rows)
    token_parallel = next(row for row in rows if row["tier"] == "token_parallel")
    assert (token_parallel["rows"], token_parallel["gemm_rows"]) == (4, 2)  # T = 3 padded to 4, 2 per rank
    assert "token_parallel  replicated" in printed.err
