"""The GPU acceptance run of one_kernel's kernel: back-to-back checked calls, then its time against the XLA tiers'.

    python scripts/gpu_acceptance.py [--calls N] [--devices all|1] [--seed S] [--json FILE|-]

Every case and mode of lab.acceptance (its docstring: what a call checks), --calls calls each on
every device, then scripts/gpu_profile.py's timing at the cases' T (skipped where the kernel runs
interpreted). Exit status (README: "GPU acceptance run"): 0 every case passed, 1 a mismatch, 2 it could not
run: a bad argument or a --json file that cannot be written (refused before any case runs), or an error during
the run (its traceback on stderr).
"""

import functools
import sys
import traceback

import jax

import gpu_profile
from k3_tail import TailConfig, Tier
from k3_tail.cli.harness import Experiment, announce_machine, positive_int, tp_mesh, use_cpu_without_gpu
from k3_tail.hardware import device_platform
from lab import acceptance


def time_against_xla_tiers(config: TailConfig, device: jax.Device, token_counts, seed: int) -> dict:
    """gpu_profile's rows at p = 8, column layout, on ``device``, and the kernel's ratios to the XLA tiers."""
    platform = device_platform(device)
    if Tier.ONE_KERNEL.record.runs_interpreted_on(platform):
        return {"skipped": f"the kernel runs interpreted on {platform}: nothing to time"}
    arguments, drop_activations = gpu_profile.input_maker(config, device, seed)
    run_xla, run_kernel = (jax.jit(functools.partial(work, config=config))
                           for work in (gpu_profile.local_work, gpu_profile.fused_local_work))
    rows = [gpu_profile.measure(case, arguments(case), run_kernel if case["tier"] == Tier.ONE_KERNEL.value else run_xla,
                                repeats=gpu_profile.GPU_REPEATS, warmup=1, hardware=None)
            for case in gpu_profile.cases(config, (acceptance.TP_SIZE,), token_counts, ("column",), platform)]
    drop_activations()
    return {"rows": rows, "ratios": acceptance.kernel_ratios(rows)}


def main(argv: list[str] | None = None, *, oracle: acceptance.Oracle = acceptance.serial_split_oracle) -> int:
    """The run (module docstring); ``oracle`` computes what each split call must equal bit for bit."""
    experiment = Experiment(__doc__, devices=False)
    experiment.parser.add_argument("--calls", type=positive_int, metavar="N", help="checked calls per case and mode "
                                   f"(default: {acceptance.GPU_CALLS} on a GPU, {acceptance.CPU_CALLS} on the CPU)")
    experiment.parser.add_argument("--devices", choices=("all", "1"), default="all",
                                   help="every device, each checking the per-rank shapes of p = 8 (default), or one")
    args = experiment.parse(argv)
    try:
        return run(experiment, args, oracle)
    except Exception:  # 1 means a mismatch and nothing else: a run that could not finish is 2
        traceback.print_exc()
        print(f"{experiment.parser.prog}: error: the run could not finish (the traceback above)", file=sys.stderr)
        return 2


def run(experiment: Experiment, args, oracle: acceptance.Oracle) -> int:
    """Every case, then the timing and the report: 0 when every case passed, 1 on a mismatch."""
    use_cpu_without_gpu()
    mesh = tp_mesh(jax.devices()[: None if args.devices == "all" else 1])
    config, device = TailConfig.kimi_k3(), mesh.devices.flat[0]
    experiment.machine = announce_machine(experiment.out)
    calls = args.calls or (acceptance.CPU_CALLS if device.platform == "cpu" else acceptance.GPU_CALLS)
    cases = acceptance.kimi_k3_cases(config, device)
    experiment.print(f"{mesh.size} x {device.device_kind!r}: {calls} calls per case and mode, seed {args.seed}")
    reports = acceptance.run_cases(cases, mesh, calls=calls, config=config, seed=args.seed, oracle=oracle)
    experiment.print("", acceptance.format_reports(reports))
    timing = time_against_xla_tiers(config, device, sorted({case.num_tokens for case in cases}), args.seed)
    passed = acceptance.all_passed(reports)
    experiment.finish(settings={"calls": calls, "devices": mesh.size, "seed": args.seed}, passed=passed,
                      cases=reports, timing=timing)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
