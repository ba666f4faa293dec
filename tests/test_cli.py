"""The command line: `python -m k3_tail demo` in a fresh process, as a user runs it."""

import importlib.util
import json
import subprocess
import sys

import pytest

from helpers import command_environment
from k3_tail.cli import build_parser, main
from k3_tail.cli.common import (
    MAX_CPU_DEVICES, all_reduce_quantization_options, describe_config, measurement_config, up_projection_options,
)
from k3_tail.config import TailConfig
from k3_tail.tiers.registry import Tier, tier_table

AOT_MISSING = importlib.util.find_spec("jax_plugins.xla_cuda13") is None


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


@pytest.mark.skipif(AOT_MISSING, reason="needs the [aot] extra (jax-cuda13-plugin and -pjrt of the installed jax)")
def test_hlo_shows_the_overlap_tier_overlapped_on_eight_h100s_reading_its_fp8_kernel():
    result = run_cli("hlo", "--tier", "overlap", "--tokens", "16", "--topology", "h100x8",
                     "--up-proj-dtype", "float8_e4m3fn")
    assert result.returncode == 0, result.stderr
    assert "overlapped: True" in result.stdout and "NVIDIA H100" in result.stdout
    assert "up projection float8_e4m3fn" in result.stdout
    gemm_lines = [line for line in result.stdout.splitlines() if "GFLOP, reads" in line]
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
    options = all_reduce_quantization_options(args)
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


def test_hlo_json_on_a_cpu_mesh_names_the_selected_tier():
    result = run_cli("hlo", "--topology", "cpu", "--devices", "4", "--tokens", "300", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["tier"] == "column_parallel" and "overlap_token_threshold" in data["tier_reason"]
    assert data["tp_size"] == 4 and data["report"]["platform"] == "cpu"
    assert "Traceback" not in result.stderr


def test_hlo_unknown_topology_is_a_one_line_error():
    result = run_cli("hlo", "--topology", "a100x8")
    assert result.returncode == 2
    assert result.stderr.startswith("k3-tail hlo: error: --topology") and "Traceback" not in result.stderr


def test_tiers_prints_the_registry_tier_table(capsys):
    assert main(["tiers"]) == 0
    assert capsys.readouterr().out == tier_table() + "\n"


def test_tiers_json_lists_every_tier_record_as_plain_data(capsys):
    assert main(["tiers", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [record["name"] for record in records] == [tier.value for tier in Tier]
    for record in records:
        tier = Tier.parse(record["name"])
        assert record["summary"] == tier.record.summary and record["schedule"] == tier.record.schedule
        assert record["needs_whole_kernel"] == tier.record.needs_whole_kernel
        assert record["compiler_options"] == {family: dict(options)
                                              for family, options in tier.record.compiler_options.items()}
    assert set(records[0]) == {
        "name", "summary", "schedule", "collectives_text", "needs_whole_kernel", "needs_unreduced_routed",
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
