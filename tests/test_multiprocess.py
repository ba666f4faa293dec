"""A TP mesh over two JAX processes of 4 CPU devices each (gloo collectives) on the loopback address.

One pair of processes runs every case of ``multiprocess_worker.CASES`` (module fixture); each case
is a test here, judged on the output of both processes. The harness stops every process once one
fails or the run outlives its limit, and reports how each ended with its stderr; the last tests
show that a failed or lonely process ends the run with such a report instead of hanging.
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

from helpers import FAST_COMPILE_XLA_FLAGS, once_per_session, script_module
from lab.multiprocess import initialize
from multiprocess_worker import CASES, TIERS_AND_LAYOUTS
from reference import TOLERANCE

WORKER = Path(__file__).with_name("multiprocess_worker.py")
LAUNCHER = Path(__file__).parent.parent / "scripts" / "run_multiprocess.py"
NUM_PROCESSES = 2
LOCAL_DEVICES = 4
RUN_LIMIT_S = 240  # start-up and every case of one pair of processes
FAILURE_LIMIT_S = 120  # the failure tests end in seconds; this only bounds a harness bug
STDERR_TAIL_LINES = 15



@dataclasses.dataclass(frozen=True)
class Ended:
    """How one child process ended."""

    process_id: int
    returncode: int  # negative: killed by that signal
    stopped: str | None  # why the harness stopped it; None when it ended by itself
    stderr: str


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (process 0's coordinator binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker_command(process_id, port, result, *, initialization_timeout=60, heartbeat_timeout=30):
    return [
        sys.executable, str(WORKER), "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(NUM_PROCESSES),
        "--process-id", str(process_id), "--local-devices", str(LOCAL_DEVICES), "--result", str(result),
        "--initialization-timeout", str(initialization_timeout), "--heartbeat-timeout", str(heartbeat_timeout),
    ]


def child_environment():
    # The parent's XLA_FLAGS could force another CPU device count than the one each process asks for; each
    # case compiles in both processes, so they compile fast (helpers.FAST_COMPILE_XLA_FLAGS). The children
    # import the lab (lab.multiprocess) from scripts/, as the launcher does.
    environment = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    return {**environment, "XLA_FLAGS": FAST_COMPILE_XLA_FLAGS,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(LAUNCHER.parent), environment.get("PYTHONPATH"))))}


def run_processes(commands, log_dir, *, limit_s, stop_all_on_failure=True) -> list[Ended]:
    """Run ``commands[i]`` as process i and wait for all of them.

    Once one exits with a non-zero status (if ``stop_all_on_failure``), or ``limit_s`` passes, the
    harness kills the ones still running: they would wait for the failed one in a collective.
    """
    processes, stderr_paths, stopped = [], [], {}
    reason = "stopped by the harness: the harness itself failed"
    try:
        for process_id, command in enumerate(commands):
            stderr_paths.append(log_dir / f"process{process_id}.stderr")
            with stderr_paths[-1].open("w") as stderr:
                # Files, not pipes: a full pipe would block the child. stdout holds only gloo's notices.
                processes.append(
                    subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=child_environment())
                )
        deadline = time.monotonic() + limit_s
        while None in (statuses := [process.poll() for process in processes]):
            failed = [i for i, status in enumerate(statuses) if status not in (None, 0)]
            if failed and stop_all_on_failure:
                reason = f"stopped by the harness after process {failed[0]} failed"
                break
            if time.monotonic() > deadline:
                reason = f"stopped by the harness: still running after {limit_s} s"
                break
            time.sleep(0.1)
    finally:
        # Also when the harness is interrupted: no child outlives it.
        for process_id, process in enumerate(processes):
            if process.poll() is None:
                process.kill()
                stopped[process_id] = reason
    return [
        Ended(process_id, process.wait(), stopped.get(process_id), path.read_text(errors="replace"))
        for process_id, (process, path) in enumerate(zip(processes, stderr_paths, strict=True))
    ]


def report(ended: list[Ended]) -> str:
    """How each process ended, one line each, then the last lines of each one's stderr."""
    lines = [f"process {e.process_id}: {e.stopped or exit_description(e.returncode)}" for e in ended]
    for e in ended:
        lines.append(f"--- process {e.process_id} stderr, last lines ---")
        lines += stderr_tail(e.stderr) or ["(empty)"]
    return "\n".join(lines)


def exit_description(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def stderr_tail(stderr: str) -> list[str]:
    # A fatal JAX error prints a C++ stack of dozens of "    @ 0x..." frames after its message.
    lines = [line for line in stderr.splitlines() if not line.lstrip().startswith("@ ")]
    return lines[-STDERR_TAIL_LINES:]


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    """Each process's JSON result, from one pair of processes running every case (once per session)."""

    def run(run_dir):
        port = free_loopback_port()
        result_paths = [run_dir / f"result{i}.json" for i in range(NUM_PROCESSES)]
        commands = [worker_command(i, port, path) for i, path in enumerate(result_paths)]
        ended = run_processes(commands, run_dir, limit_s=RUN_LIMIT_S)
        if any(e.returncode != 0 for e in ended):
            return {"failure": f"the {NUM_PROCESSES} processes did not all succeed:\n{report(ended)}"}
        return {"results": [json.loads(path.read_text()) for path in result_paths]}

    _, outcome = once_per_session(tmp_path_factory, "multiprocess", run, timeout_s=RUN_LIMIT_S + 30)
    if "failure" in outcome:
        pytest.fail(outcome["failure"], pytrace=False)
    return outcome["results"]


def test_every_process_sees_the_devices_of_all_processes(results):
    for process_id, result in enumerate(results):
        assert result["process_id"] == process_id
        assert result["process_count"] == NUM_PROCESSES
        assert result["local_device_count"] == LOCAL_DEVICES
        assert result["device_count"] == NUM_PROCESSES * LOCAL_DEVICES


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_every_process_gets_the_float64_reference(case, results):
    for process_id, result in enumerate(results):
        outcome = result["cases"][case.id]
        assert "exception" not in outcome, f"process {process_id}: {outcome.get('exception')}"
        assert outcome["shape"] == [case.num_tokens, case.hidden_size]
        assert outcome["dtype"] == case.dtype
        assert outcome["replicated"]
        assert outcome["error"] <= TOLERANCE[jnp.dtype(case.dtype)], f"process {process_id}"


def test_a_failing_process_stops_the_others_and_the_report_shows_both(tmp_path):
    port = free_loopback_port()
    commands = [
        worker_command(0, port, tmp_path / "result0.json"),
        [sys.executable, "-c", "import sys; sys.exit('process 1 fails on purpose')"],
    ]
    ended = run_processes(commands, tmp_path, limit_s=FAILURE_LIMIT_S)
    text = report(ended)
    assert ended[1].stopped is None and ended[1].returncode == 1
    assert ended[0].stopped == "stopped by the harness after process 1 failed"
    assert "process 0: stopped by the harness after process 1 failed" in text
    assert "process 1: exited with status 1" in text
    assert "--- process 0 stderr, last lines ---" in text
    assert "process 1 fails on purpose" in text


def test_a_process_whose_peer_never_comes_ends_by_itself(tmp_path):
    """Process 0 of 2 alone: its initialization timeout ends it with JAX's reason, not the harness."""
    command = worker_command(0, free_loopback_port(), tmp_path / "result0.json", initialization_timeout=1)
    (alone,) = run_processes([command], tmp_path, limit_s=FAILURE_LIMIT_S)
    assert alone.stopped is None
    assert alone.returncode != 0
    assert "RegisterTask" in report([alone])  # the coordination service's call that timed out


def test_a_process_whose_peer_dies_after_joining_ends_by_itself(tmp_path):
    """Process 1 joins, then dies: process 0's heartbeat timeout ends it, with no harness to stop it."""
    port = free_loopback_port()
    join_then_die = (
        "import os; from lab.multiprocess import initialize; "
        f"initialize('127.0.0.1:{port}', {NUM_PROCESSES}, 1, local_cpu_devices={LOCAL_DEVICES}); os._exit(3)"
    )
    commands = [
        worker_command(0, port, tmp_path / "result0.json", heartbeat_timeout=2),
        [sys.executable, "-c", join_then_die],
    ]
    ended = run_processes(commands, tmp_path, limit_s=FAILURE_LIMIT_S, stop_all_on_failure=False)
    assert ended[1].returncode == 3
    assert ended[0].stopped is None
    assert ended[0].returncode != 0
    assert "heartbeat" in report(ended)


@pytest.fixture(scope="module")
def launcher():
    """scripts/run_multiprocess.py as a module (scripts/ is no package)."""
    return script_module(LAUNCHER)


def test_the_launcher_runs_every_tier_on_local_processes():
    command = [
        sys.executable, str(LAUNCHER), "--local", str(NUM_PROCESSES), "--small", "--tokens", "5",
        "--timeout", str(RUN_LIMIT_S - 30),  # it stops its own processes before this test gives up on it
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, env=child_environment(), timeout=RUN_LIMIT_S, check=False
    )
    assert result.returncode == 0, result.stderr
    device_count = NUM_PROCESSES * LOCAL_DEVICES
    assert f"tp={device_count} over {device_count} cpu devices in {NUM_PROCESSES} processes" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("  ")]
    expected_rows = [(tier.value, layout, "ok") for tier, layout in TIERS_AND_LAYOUTS]
    assert sorted((row[0], row[1], row[-1]) for row in rows) == sorted(expected_rows)
    assert "every tier and layout is within 0.01 of the float64 reference" in result.stdout
    assert "[Gloo]" not in result.stdout  # gloo's connection notices are left out unless --verbose


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--coordinator", "host0:1234", "--num-processes", "2"],
        ["--coordinator", "host0:1234", "--num-processes", "2", "--process-id", "2"],
        ["--local", "2", "--process-id", "0"],
        ["--local", "0"],
        ["--local", "2", "--tokens", "16,x"],
        ["--local", "2", "--seed", "-1"],
    ],
    ids=["nothing", "no_process_id", "process_id_too_large", "local_with_process_id", "no_processes", "bad_tokens",
         "negative_seed"],
)
def test_the_launcher_rejects_bad_arguments_with_a_usage_error(argv, launcher, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(argv)
    assert exit_info.value.code == 2
    assert "usage: run_multiprocess.py" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["nonsense", "host:99999", ":80"])
def test_the_launcher_refuses_a_malformed_coordinator_address_as_a_usage_error(address, launcher, capsys):
    """Refused while parsing (in this process: nothing has started yet)."""
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["--coordinator", address, "--num-processes", "2", "--process-id", "1", "--cpu-devices", "1"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "argument --coordinator: expected HOST:PORT" in error and repr(address) in error


def test_the_launcher_with_an_unreachable_coordinator_exits_1_naming_it(launcher, capsys):
    """Process 1 of 2, no process 0: it gives up after --connect-timeout, exit status 1, before JAX's distributed
    runtime starts (in this process, which joins nothing: JAX would end it in a C++ abort)."""
    address = f"127.0.0.1:{free_loopback_port()}"
    status = launcher.main(["--coordinator", address, "--num-processes", "2", "--process-id", "1",
                            "--cpu-devices", "1", "--connect-timeout", "1"])
    error = capsys.readouterr().err
    assert status == 1, error
    assert f"run_multiprocess.py: error: coordinator {address}: nothing accepts connections there" in error
    assert "Traceback" not in error


def test_the_launcher_as_process_0_on_a_port_in_use_exits_1_naming_it(launcher, capsys):
    """Process 0 cannot serve the coordinator on a port another program listens on: exit status 1, before JAX's
    distributed runtime starts (in this process, which joins nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other_program:
        other_program.bind(("127.0.0.1", 0))
        other_program.listen()
        address = f"127.0.0.1:{other_program.getsockname()[1]}"
        status = launcher.main(["--coordinator", address, "--num-processes", "2", "--process-id", "0",
                                "--cpu-devices", "1"])
    error = capsys.readouterr().err
    assert status == 1, error
    assert f"run_multiprocess.py: error: coordinator {address}: process 0 cannot listen on port" in error
    assert "Traceback" not in error


@pytest.mark.parametrize(
    "bad",
    [
        {"coordinator_address": "127.0.0.1"},
        {"coordinator_address": "127.0.0.1:0"},
        {"coordinator_address": 1234},
        {"num_processes": 0},
        {"process_id": -1},
        {"process_id": 2},
        {"local_cpu_devices": 0},
        {"initialization_timeout": 0},
        {"connect_timeout": 0},
        {"heartbeat_timeout_seconds": 1.5},
        {"shutdown_timeout_seconds": None},
    ],
    ids=lambda bad: ",".join(f"{name}={value!r}" for name, value in bad.items()),
)
def test_initialize_rejects_a_bad_argument_naming_it(bad):
    """Checked before JAX is touched: this process joins nothing."""
    arguments = {"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 0, **bad}
    (name,) = bad
    with pytest.raises(ValueError, match=f"^{name}: "):
        initialize(**arguments)
