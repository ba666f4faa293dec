"""The command line: `python -m k3_tail demo` in a fresh process, as a user runs it."""

import os
import subprocess
import sys

import pytest

from k3_tail.cli import main


def test_demo_builds_its_own_mesh_and_all_tiers_agree_with_native():
    environment = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
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


@pytest.mark.parametrize("argv", [["demo", "--tokens", "0"], ["demo", "--repeats", "x"], ["frobnicate"], []])
def test_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: k3-tail" in capsys.readouterr().err
