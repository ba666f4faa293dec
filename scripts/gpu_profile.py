"""Each tier's per-rank local work (no collectives) on one device, against the device's peaks.

    python scripts/gpu_profile.py [--tp-sizes 4,8] [--tokens 1,2,...,8192] [--weight-layout both]
                                  [--repeats 20] [--hardware PRESET] [--json FILE|-]

Method and results: docs/measurements/2026-11-30-gpu-profile.md.
"""

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3_tail import TailConfig, padded_token_count
from k3_tail.cli.harness import (
    Experiment,
    add_shape_arguments,
    announce_machine,
    positive_int,
    positive_int_list,
    progress,
    stepped,
    use_cpu_without_gpu,
)
from k3_tail.cli.tables import format_ms, format_table, median_columns, quartiles_ms
from k3_tail.hardware import HARDWARE, Hardware, device_platform
from k3_tail.tiers.registry import Tier
from k3_tail.tools.benchmark import config_dict, default_token_counts, tiers_for, time_runs
from lab.blocks import WEIGHT_LAYOUTS, norm_project_add, rms_norm

DEFAULT_TP_SIZES = (4, 8)
GPU_REPEATS = 20
CPU_REPEATS = 5
# Device kinds (a device's ``.device_kind``, upper-cased) that name a cost-model preset, by substring.
DEVICE_KIND_PRESETS = (("MI300X", "mi300x"), ("MI325X", "mi325x"), ("MI355X", "mi355x"), ("H200", "h200"))


def cases(config: TailConfig, tp_sizes, token_counts, layouts, platform: str) -> list[dict[str, Any]]:
    """Every (p, T, layout, tier) the registry's tiers run (compiled on ``platform``: not one_kernel's
    interpreted kernel on a CPU), p-major, then T, layout, registry order: the first fields of its row, with
    the shapes of its rank's local work (module docstring)."""
    result = []
    for tp_size, num_tokens, layout in itertools.product(tp_sizes, token_counts, layouts):
        for record in (tier.record for tier in tiers_for(layout, config, platform=platform)):
            rows = padded_token_count(num_tokens, tp_size) if record.splits_tokens else num_tokens
            result.append({"tier": record.name, "weight_layout": layout, "tp_size": tp_size, "num_tokens": num_tokens,
                           "rows": rows, "gemm_rows": record.gemm_rows(rows, tp_size),
                           "gemm_columns": record.gemm_columns(config.hidden_size, tp_size, layout)})
    return result


def local_work(latent, norm_weight, kernel, shared, *, config: TailConfig):
    """A rank's work between collectives (module docstring): norm, cast, GEMM, add, cast."""
    normed = rms_norm(latent, norm_weight, config)
    projected = jnp.dot(normed.astype(config.dtype), kernel, preferred_element_type=jnp.float32)
    return (projected + shared.astype(jnp.float32)).astype(config.dtype)


def fused_local_work(latent, norm_weight, kernel, shared, *, config: TailConfig):
    """The same work as one_kernel does it: its one Pallas kernel (module docstring)."""
    return norm_project_add(latent, norm_weight, kernel, shared, config)


def input_maker(config: TailConfig, device: jax.Device, seed: int):
    """(A function giving a case's random arguments on ``device``: latent rows, norm weight, kernel block,
    shared rows; a function dropping the activations kept so far). Every kernel block is a slice of one
    [L, H] kernel, made once; the activations are kept for the cases of one (p, T)."""
    rng = np.random.default_rng(seed)

    def put(host: np.ndarray) -> jax.Array:
        return jax.device_put(jnp.asarray(host, dtype=config.dtype), device)

    norm_weight = put(1 + 0.1 * rng.standard_normal(config.latent_size, dtype=np.float32))
    host_kernel = (rng.standard_normal((config.latent_size, config.hidden_size), dtype=np.float32)
                   / np.sqrt(config.latent_size))
    kernel = functools.cache(lambda columns: put(host_kernel[:, :columns]))
    activation = functools.cache(lambda rows, columns: put(rng.standard_normal((rows, columns), dtype=np.float32)))

    def arguments(case: dict[str, Any]) -> tuple[jax.Array, ...]:
        return (activation(case["gemm_rows"], config.latent_size), norm_weight, kernel(case["gemm_columns"]),
                activation(case["gemm_rows"], case["gemm_columns"]))

    return arguments, activation.cache_clear


def choose_hardware(requested: str | None, device: jax.Device) -> tuple[Hardware | None, str | None]:
    """The preset to compare with (None: none, on the CPU only) and a note to print, or ValueError."""
    kind = device.device_kind.upper()
    detected = None if device.platform == "cpu" else next(
        (preset for marker, preset in DEVICE_KIND_PRESETS if marker in kind), None)
    if requested is None:
        if detected is not None:
            return HARDWARE[detected], None
        if device.platform == "cpu":
            return None, "no --hardware on the CPU: no fractions of a device's peaks"
        raise ValueError(f"--hardware: no preset for device kind {device.device_kind!r}; give one of "
                         f"{', '.join(sorted(HARDWARE))}")
    if device.platform == "cpu":
        return HARDWARE[requested], (f"the {requested} preset's peaks against the CPU: the fractions are meaningless "
                                     "here")
    if detected is not None and detected != requested:
        return HARDWARE[requested], (f"--hardware {requested} on a {device.device_kind!r} device (its preset would be "
                                     f"{detected})")
    return HARDWARE[requested], None


def measure(case: dict[str, Any], arguments: tuple[jax.Array, ...], run_jitted, *, repeats: int, warmup: int,
            hardware: Hardware | None) -> dict[str, Any]:
    """Time ``case``'s local work on ``arguments`` and return its row (module docstring)."""
    output, warmup_s, timing = time_runs(functools.partial(run_jitted, *arguments), repeats=repeats, warmup=warmup)
    nbytes = dict(zip(("latent", "norm_weight", "kernel", "shared"), (a.nbytes for a in arguments), strict=True))
    nbytes["output"] = output.nbytes
    flops = 2 * case["gemm_rows"] * arguments[0].shape[1] * case["gemm_columns"]
    flops_per_s, bytes_per_s = flops / timing.median_s, sum(nbytes.values()) / timing.median_s
    return {
        **case, **dataclasses.asdict(timing), "warmup_s": warmup_s, "gemm_flops": flops,
        "bytes_moved": sum(nbytes.values()), "bytes": nbytes, "tflops_per_s": flops_per_s / 1e12,
        "gb_per_s": bytes_per_s / 1e9,
        "peak_flops_fraction": None if hardware is None else flops_per_s / hardware.peak_flops,
        "hbm_bandwidth_fraction": None if hardware is None else bytes_per_s / hardware.hbm_bytes_per_s,
    }


def three_digits(value: float) -> str:
    """``value`` with about 3 significant digits and no exponent (0.00123, 1.23, 123, 1234)."""
    digits = next((d for d, bound in ((5, 0.01), (4, 0.1), (3, 1), (2, 10), (1, 100)) if value < bound), 0)
    return f"{value:.{digits}f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__, devices=False, warmup=1)
    add = experiment.parser.add_argument
    add("--tp-sizes", type=positive_int_list, default=DEFAULT_TP_SIZES, metavar="P,P,...",
        help="TP sizes p whose per-rank work to time (default: 4,8)")
    add("--tokens", type=positive_int_list, metavar="T,T,...",
        help="token counts (default: 1, 2, 4, ... 8192; on the CPU up to 1024)")
    add("--weight-layout", choices=(*WEIGHT_LAYOUTS, "both"), default="both",
        help="kernel layouts to time each tier with (default: both)")
    add("--repeats", type=positive_int, metavar="N",
        help=f"timed runs per case (default: {GPU_REPEATS} on a GPU, {CPU_REPEATS} on the CPU)")
    add("--hardware", type=str.lower, choices=sorted(HARDWARE),
        help="cost-model preset whose peaks to compare with (default: from the device kind)")
    add_shape_arguments(experiment.parser.add_argument_group("config (default: Kimi-K3)"))
    args = experiment.parse(argv)

    use_cpu_without_gpu()
    device = jax.devices()[0]
    try:
        hardware, note = choose_hardware(args.hardware, device)
    except ValueError as error:
        experiment.error(str(error))
    config = TailConfig.kimi_k3(hidden_size=args.hidden_size, latent_size=args.latent_size, dtype=args.dtype)
    repeats = args.repeats or (CPU_REPEATS if device.platform == "cpu" else GPU_REPEATS)
    token_counts = args.tokens or default_token_counts(device.platform)
    layouts = WEIGHT_LAYOUTS if args.weight_layout == "both" else (args.weight_layout,)
    experiment.machine = announce_machine(experiment.out)
    experiment.print(
        f"device {device.platform} {device.device_kind!r}; config: H={config.hidden_size}, L={config.latent_size}, "
        f"{config.dtype.name}; p in {','.join(map(str, args.tp_sizes))}; T in {','.join(map(str, token_counts))}; "
        f"layouts {', '.join(layouts)}; {args.warmup} warm-up + {repeats} timed runs each; seed {args.seed}")
    if hardware is not None:
        experiment.print(f"hardware: {hardware.name}, peak {hardware.peak_flops / 1e12:.1f} TFLOP/s (dense BF16), HBM "
                         f"{hardware.hbm_bytes_per_s / 1e9:.0f} GB/s")
    if note is not None:
        experiment.print(f"note: {note}")

    progress("dispatch floor")
    one = jax.device_put(jnp.zeros((1,), jnp.float32), device)
    _, _, floor = time_runs(functools.partial(jax.jit(lambda x: x + 1), one), repeats=repeats, warmup=args.warmup)
    experiment.print(f"dispatch floor (jitted one-element add): median {format_ms(floor.median_s)} ms, q25-q75 "
                     f"{quartiles_ms(floor)} ms")

    todo = cases(config, args.tp_sizes, token_counts, layouts, device_platform(device))
    arguments, drop_activations = input_maker(config, device, args.seed)
    run_xla = jax.jit(functools.partial(local_work, config=config))
    run_fused = jax.jit(functools.partial(fused_local_work, config=config))
    rows, group = [], None
    for case in stepped(todo, lambda case: f"p={case['tp_size']} T={case['num_tokens']} {case['tier']} "
                        f"{case['weight_layout']}"):
        if (case["tp_size"], case["num_tokens"]) != group:
            drop_activations()
            group = case["tp_size"], case["num_tokens"]
        run_jitted = run_fused if case["tier"] == Tier.ONE_KERNEL.value else run_xla
        rows.append(measure(case, arguments(case), run_jitted, repeats=repeats, warmup=args.warmup, hardware=hardware))
    drop_activations()
    experiment.print("", format_table(rows, [
        ("p", ">3", lambda r: r["tp_size"]), ("T", ">6", lambda r: r["num_tokens"]), ("", "2", lambda r: ""),
        ("tier", "<16", lambda r: r["tier"]), ("layout", "<11", lambda r: r["weight_layout"]),
        ("rows", ">6", lambda r: r["gemm_rows"]), ("cols", ">6", lambda r: r["gemm_columns"]),
        *median_columns(lambda r: r, (11, 19)),
        ("TFLOP/s", ">9", lambda r: three_digits(r["tflops_per_s"])),
        ("%peak", ">7", lambda r: percent(r["peak_flops_fraction"])),
        ("GB/s", ">8", lambda r: three_digits(r["gb_per_s"])),
        ("%HBM", ">7", lambda r: percent(r["hbm_bandwidth_fraction"])),
    ], group=lambda r: (r["tp_size"], r["num_tokens"]), notes=[
        "", "rows x cols: one rank's GEMM [rows, L] x [L, cols]; TFLOP/s counts its 2*rows*L*cols FLOPs, GB/s the "
        "bytes of its inputs and output; %peak and %HBM: of the preset's peaks"]))
    return experiment.finish(
        device={"platform": device.platform, "device_kind": device.device_kind, "id": device.id},
        settings={"tp_sizes": args.tp_sizes, "tokens": token_counts, "weight_layouts": layouts, "repeats": repeats,
                  "warmup": args.warmup, "seed": args.seed},
        config=config_dict(config), hardware=hardware, hardware_note=note, dispatch_floor=floor, rows=rows)


if __name__ == "__main__":
    raise SystemExit(main())
