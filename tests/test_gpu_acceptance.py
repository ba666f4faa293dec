"""scripts/gpu_acceptance.py on the CPU, in this process (its main), at Kimi-K3's shapes with its CPU defaults.

On the CPU the kernel runs interpreted: the run exercises the checks' code, not the split's memory ordering,
and reports the command-buffer mode and the timing as not applicable. What the GPU compiles for the two modes
is checked on deviceless GPU topologies. How a mismatch fails the run and which rank each device checks do not
depend on Kimi-K3's size: those tests run at small shapes whose grid still splits K (an interpreted call at
Kimi-K3's shapes takes seconds).
"""

import functools
import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import k3_tail
from helpers import gpu_mesh_for, once_per_session, script_module, topology_params
from k3_tail.cli.harness import tp_mesh
from lab import acceptance

SCRIPTS = Path(__file__).parent.parent / "scripts"
KIMI_K3 = k3_tail.TailConfig.kimi_k3()
# Kimi-K3's tail at H = L = 256: a rank's [256, 32] block in a grid of 8 programs, K split in 4.
SMALL = k3_tail.TailConfig.kimi_k3(hidden_size=256, latent_size=256)
RUN_LIMIT_S = 600  # how long a worker waits for the CPU run another worker makes
# On a GPU backend (JAX_PLATFORMS=rocm) the run is the real one, minutes long: the README's command, not a test.
on_the_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU run; a GPU runs the script itself")


@pytest.fixture(scope="module")
def script():
    """scripts/gpu_acceptance.py as a module (scripts/ is no package; it imports gpu_profile beside it)."""
    return script_module(SCRIPTS / "gpu_acceptance.py")


@pytest.fixture(scope="module")
def passing_run(script, tmp_path_factory):
    """(exit status, JSON report) of the CPU run on one device, once per session: about half a minute, which a
    second pytest-xdist worker taking some of these tests would otherwise spend again."""
    def run(directory):
        path = directory / "report.json"
        status = script.main(["--devices", "1", "--json", str(path)])
        return {"status": status, "report": json.loads(path.read_text())}

    _, outcome = once_per_session(tmp_path_factory, "gpu_acceptance", run, timeout_s=RUN_LIMIT_S)
    return outcome["status"], outcome["report"]


@on_the_cpu
def test_the_cpu_run_passes(passing_run):
    status, report = passing_run
    assert status == 0 and report["passed"] is True


@on_the_cpu
def test_every_case_is_checked_plain_with_k_split_and_within_tolerance(passing_run):
    _, report = passing_run
    plain = [case for case in report["cases"] if case["mode"] == "plain"]
    cases = acceptance.kimi_k3_cases(KIMI_K3, jax.devices()[0])
    assert [case["case"] for case in plain] == [case.name for case in cases]
    for case in plain:
        assert case["status"] == "pass" and case["calls"] == acceptance.CPU_CALLS and case["splits"] > 1
        assert case["mismatches"] == 0 and case["nonfinite"] == 0
        assert 0 < case["max_relative_error"] <= case["tolerance"] == acceptance.RELATIVE_TOLERANCE
        assert (case["device_kind"], case["jax"]) == ("cpu", jax.__version__)
    assert {case["kernel"] for case in plain} == {"bfloat16", "float8_e4m3fn"}


@on_the_cpu
def test_the_calls_cover_every_rank(passing_run):
    _, report = passing_run
    assert set().union(*(case.get("ranks", ()) for case in report["cases"])) == set(range(acceptance.TP_SIZE))


@on_the_cpu
def test_command_buffers_and_timing_are_reported_not_applicable_on_the_cpu(passing_run):
    _, report = passing_run
    graphed = [case for case in report["cases"] if case["mode"] == "command_buffers"]
    assert graphed and all(case["status"] == "not applicable on cpu" and "calls" not in case for case in graphed)
    assert "interpreted" in report["timing"]["skipped"]


def one_flipped_bit(latent, norm_weight, kernel, addend, **arguments):
    """The serial oracle with the lowest bit of its first element flipped: wrong by one bf16 ulp."""
    bits = lax.bitcast_convert_type(acceptance.serial_split_oracle(latent, norm_weight, kernel, addend, **arguments),
                                    jnp.uint16)
    return lax.bitcast_convert_type(bits.at[0, 0].set(bits[0, 0] ^ 1), jnp.bfloat16)


@on_the_cpu
def test_a_mismatch_with_the_oracle_fails_the_case_and_the_run(monkeypatch, tmp_path, script):
    """One case at small shapes is enough (each case compiles its own interpreted program): a one-ulp difference
    fails it, and the command exits 1."""
    monkeypatch.setattr(acceptance, "kimi_k3_cases", lambda config, device: (acceptance.Case(1, "bfloat16"),))
    monkeypatch.setattr(script, "TailConfig", types.SimpleNamespace(kimi_k3=functools.partial(
        k3_tail.TailConfig.kimi_k3, hidden_size=SMALL.hidden_size, latent_size=SMALL.latent_size)))
    path = tmp_path / "report.json"
    assert script.main(["--calls", "1", "--devices", "1", "--json", str(path)], oracle=one_flipped_bit) == 1
    report = json.loads(path.read_text())
    (plain,) = [case for case in report["cases"] if case["mode"] == "plain"]
    assert report["passed"] is False
    assert plain["status"] == "fail" and plain["mismatches"] == plain["mismatching_calls"] == 1
    assert plain["splits"] > 1


@pytest.mark.parametrize("json_path", ["missing/report.json", "."])
def test_a_json_path_it_cannot_write_exits_2_before_any_case_runs(json_path, monkeypatch, tmp_path, script, capsys):
    monkeypatch.setattr(acceptance, "run_cases", lambda *args, **kwargs: pytest.fail("a case ran"))
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--devices", "1", "--json", str(tmp_path / json_path)])
    assert exit_info.value.code == 2 and "error: --json: " in capsys.readouterr().err


def test_a_run_that_cannot_finish_exits_2_not_1(monkeypatch, script, capsys):
    """1 means a mismatch and nothing else."""
    def broken_oracle(*args, **kwargs):
        raise RuntimeError("the oracle cannot run here")

    monkeypatch.setattr(acceptance, "kimi_k3_cases", lambda config, device: (acceptance.Case(1, "bfloat16"),))
    assert script.main(["--calls", "1", "--devices", "1"], oracle=broken_oracle) == 2
    error = capsys.readouterr().err
    assert "RuntimeError: the oracle cannot run here" in error and "error: the run could not finish" in error


@on_the_cpu
def test_every_device_checks_a_rank_of_its_own():
    """Call c on device d is rank (c + d) mod p: call 7 on two devices checks ranks 7 and 0."""
    mesh = tp_mesh(jax.devices()[:2])
    report = acceptance.run_case(acceptance.Case(1, "bfloat16"), "plain", mesh, calls=1, first_call=7, config=SMALL,
                                 seed=1)
    assert report["status"] == "pass" and report["devices"] == 2 and report["ranks"] == [0, 7]
    assert report["splits"] > 1


@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8"))
def test_the_command_buffer_mode_compiles_to_one_graph_and_plain_to_none(topology):
    """The whole checked call in one kCommandBuffer thunk (XLA's dump), or in none; one device of the topology."""
    mesh = tp_mesh(gpu_mesh_for(topology).devices.flat[:1])
    case = acceptance.Case(16, "bfloat16")
    thunks = {mode: acceptance.compile_check(case, mode, mesh, config=KIMI_K3, seed=0,
                                             oracle=acceptance.serial_split_oracle)[1] for mode in acceptance.MODES}
    assert thunks == {"plain": 0, "command_buffers": 1}
