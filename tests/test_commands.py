"""The Kimi-K3 model's commands: the example scripts, the layer's two experiments in scripts/ and the model's own
modules run with ``python -m`` (tests/test_cli.py has ``k3-tail``'s). Each says what it does under ``--help`` and
exits 0; a bad flag exits 2 before it runs anything. Both are argparse's answers before the command does any work,
so they are asked of each command's ``main(argv)`` in this process; the example runs as a user starts it."""

import contextlib
import importlib
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import command_environment, script_module

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(str(path.relative_to(ROOT)) for pattern in ("examples/*.py", "scripts/kimi_k3_*.py")
                 for path in ROOT.glob(pattern))
MODULES = ["k3_tail.models.kimi_k3.figures", "k3_tail.models.kimi_k3.stack"]
COMMANDS = SCRIPTS + MODULES


def command_main(command):
    """The command's ``main(argv)``: a module's, or a script's loaded from its file (scripts/ is no package; a script
    may import another beside it)."""
    if command in MODULES:
        return importlib.import_module(command).main
    return script_module(ROOT / command).main


def exit_of(command, argv):
    """(exit status, stdout, stderr) of ``command``'s main on ``argv``, which must end in argparse's exit."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        command_main(command)(argv)
    return exited.value.code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_says_what_it_does_under_help(command):
    status, out, _ = exit_of(command, ["--help"])
    usage, _, description = out.partition("\n\n")
    assert status == 0 and usage.startswith("usage:") and len(description.split()) >= 5


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_flag_exits_2_before_running(command):
    status, out, err = exit_of(command, ["--no-such-flag"])
    assert status == 2 and "unrecognized arguments: --no-such-flag" in err and not out


def test_the_decode_example_checks_the_layer_against_its_float64_reference():
    result = subprocess.run([sys.executable, "examples/kimi_k3_decode.py", "--tokens", "1", "--width-divisor", "32"],
                            cwd=ROOT, env=command_environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    error = float(result.stdout.rsplit("float64: ", 1)[1])
    assert error <= 1e-2  # bf16 (tests/test_kimi_k3_layer.py's tolerance)
