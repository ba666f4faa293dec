"""Every command of the repository outside ``k3-tail`` (tests/test_cli.py has those): the example scripts, the
experiments in scripts/ and the model's own modules run with ``python -m``. Each says what it does under
``--help`` and exits 0; a bad flag exits 2 before it runs anything."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import command_environment

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(str(path.relative_to(ROOT)) for pattern in ("examples/*.py", "scripts/*.py")
                 for path in ROOT.glob(pattern))
MODULES = ["k3_tail.models.kimi_k3.figures", "k3_tail.models.kimi_k3.stack"]
COMMANDS = [[path] for path in SCRIPTS] + [["-m", module] for module in MODULES]


def run(arguments):
    return subprocess.run([sys.executable, *arguments], cwd=ROOT, env=command_environment(), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(command) for command in COMMANDS])
def test_every_command_says_what_it_does_under_help(command):
    result = run([*command, "--help"])
    assert result.returncode == 0, result.stderr
    usage, _, description = result.stdout.partition("\n\n")
    assert usage.startswith("usage:") and len(description.split()) >= 5


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(command) for command in COMMANDS])
def test_a_bad_flag_exits_2_before_running(command):
    result = run([*command, "--no-such-flag"])
    assert result.returncode == 2 and "error:" in result.stderr and not result.stdout


def test_the_decode_example_checks_the_layer_against_its_float64_reference():
    result = run(["examples/kimi_k3_decode.py", "--tokens", "1", "--width-divisor", "32"])
    assert result.returncode == 0, result.stderr
    error = float(result.stdout.rsplit("float64: ", 1)[1])
    assert error <= 1e-2  # bf16 (tests/test_kimi_k3_layer.py's tolerance)
