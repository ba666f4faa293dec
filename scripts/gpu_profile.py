"""Each tier's per-rank local work (no collectives) on one device, against the device's peaks.

    python scripts/gpu_profile.py [--tp-sizes 4,8] [--tokens 1,2,...,8192] [--weight-layout both]
                                  [--repeats 20] [--hardware PRESET] [--json FILE|-]

What is timed: what one TP rank of a tier computes between its collectives, built from the tier's
record (k3_tail.tiers.registry.TIER_RECORDS), for every TP size p of --tp-sizes, token count T of
--tokens and weight layout of --weight-layout the tier runs with (a tier that needs the whole
kernel only with "replicated"):

  token rows   rows = T, or for a tier that shards tokens (record.shards_tokens) T rounded up to a
               multiple of p (padded_token_count); the rank works on record.gemm_rows(rows, p) of
               them (T'/p for token_parallel, all T for the others);
  columns      record.gemm_columns(H, p, layout): H for a tier that projects all columns with the
               replicated kernel, else its column block padded_hidden_size(H, p) / p;
  work         latent [rows, L] in config.dtype -> RMSNorm in float32 with the norm weight [L]
               (k3_tail.ops.norm.rms_norm, config's eps and scale) -> cast to config.dtype -> dot
               with the kernel block [L, columns] (preferred_element_type float32) -> + the shared
               partial's rows [rows, columns] in float32 -> cast to config.dtype.

That is the shape of every tier's local work. Approximations, all elementwise: one_shot really
scales and weights its own routed partial before the GEMM, packs [z | s | x] for its all-reduce and
applies the row RMS factor after it; native and overlap with the column layout add the shared sum
after gathering the blocks (on [T, H]); column_parallel writes its block back into its [T, H]
buffer. Here each is the same-shaped norm, GEMM, add and casts above.

How: one jax.jit of that function on jax.devices()[0] (a GPU when there is one; otherwise the CPU,
selected before JAX starts as the k3-tail commands do, so that an installed CUDA plugin prints no
traceback). Inputs are random (--seed) and put on the device before timing. Each case runs
--warmup times untimed (the first run of a new shape compiles), then --repeats timed runs
(k3_tail.tools.benchmark.time_runs: wall time with Python dispatch, each run waiting for its
result). Default repeats: 20 on a GPU, 5 on the CPU. Default tokens: 1, 2, 4, ... 8192; on the
CPU up to 1024, as `k3-tail bench` (Kimi-K3's 2TLH = 421 GFLOP at T = 8192 takes seconds per run
on a few cores). The dispatch floor, a jitted one-element add timed the same way, is printed
first: a median near it is Python dispatch and launch, not the work.

Reported per (p, T, tier, layout): median and quartiles (s); GEMM FLOPs 2 * rows * L * columns
(the norm's and the add's few FLOPs not counted); bytes moved, the sizes of the arrays read and
written: kernel block, norm weight, latent and shared rows in, the output out; achieved TFLOP/s
and GB/s (over the median), and their fractions of the hardware preset's peak_flops (dense BF16,
whatever --dtype is) and hbm_bytes_per_s. The preset (k3_tail.hardware.HARDWARE) is
--hardware, or by default the one of the device kind: "H200" -> h200, "MI300X" -> mi300x,
"MI325X" -> mi325x, "MI355X" -> mi355x; on another GPU --hardware is required. On the CPU any
preset may be given and the fractions are then meaningless (a GPU's peaks against the host's
cores); without --hardware the CPU run reports no fractions.

Config: Kimi-K3 (TailConfig.kimi_k3(): H = 7168, L = 3584, bf16) unless --hidden-size,
--latent-size or --dtype say otherwise. Output: the table on stdout (on stderr with --json -),
progress on stderr; --json FILE (or - for stdout) writes the machine (machine_info), the device,
the settings, the config, the preset, the dispatch floor and every row. Exit status 0, or 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3_tail import WEIGHT_LAYOUTS, TailConfig
from k3_tail.cli.common import (
    ProgressBar, add_shape_arguments, format_ms, positive_int, positive_int_list, progress, use_cpu_without_gpu,
)
from k3_tail.hardware import HARDWARE, Hardware
from k3_tail.ops.norm import rms_norm
from k3_tail.tiers.record import TierRecord
from k3_tail.tiers.registry import TIER_RECORDS
from k3_tail.ops.tokens import padded_token_count
from k3_tail.tools.benchmark import Timing, config_dict, default_token_counts, machine_info, time_runs

PROG = "gpu_profile.py"
DEFAULT_TP_SIZES = (4, 8)
GPU_REPEATS = 20
CPU_REPEATS = 5
# Device kinds (a device's ``.device_kind``, upper-cased) that name a cost-model preset, by substring.
DEVICE_KIND_PRESETS = (("MI300X", "mi300x"), ("MI325X", "mi325x"), ("MI355X", "mi355x"), ("H200", "h200"))


@dataclasses.dataclass(frozen=True)
class Case:
    """One (tier, layout, p, T) and the shapes of its rank's local work."""

    record: TierRecord
    weight_layout: str
    tp_size: int
    num_tokens: int
    rows: int  # the token rows the tier works on: T, or T padded to a multiple of p when it shards tokens
    gemm_rows: int  # this rank's rows of them: record.gemm_rows(rows, p)
    columns: int  # record.gemm_columns(H, p, layout)

    @property
    def label(self) -> str:
        return f"p={self.tp_size} T={self.num_tokens} {self.record.name} {self.weight_layout}"


def cases(config: TailConfig, tp_sizes, token_counts, layouts) -> list[Case]:
    """Every (p, T, layout, tier) the registry's tiers run, p-major, then T, layout, registry order."""
    result = []
    for tp_size in tp_sizes:
        for num_tokens in token_counts:
            for layout in layouts:
                for record in TIER_RECORDS:
                    if record.why_not(layout, config) is not None:
                        continue
                    rows = padded_token_count(num_tokens, tp_size) if record.shards_tokens else num_tokens
                    result.append(Case(record, layout, tp_size, num_tokens, rows, record.gemm_rows(rows, tp_size),
                                       record.gemm_columns(config.hidden_size, tp_size, layout)))
    return result


def local_work(latent, norm_weight, kernel, shared, *, config: TailConfig):
    """A rank's work between collectives (module docstring): norm, cast, GEMM, add, cast."""
    normed = rms_norm(latent, norm_weight, eps=config.rms_norm_eps, scale=config.routed_scaling_factor)
    projected = jnp.dot(normed.astype(config.dtype), kernel, preferred_element_type=jnp.float32)
    return (projected + shared.astype(jnp.float32)).astype(config.dtype)


class Inputs:
    """Random inputs on ``device``: the norm weight and the kernel blocks (made once), and the
    activations of the current (p, T) (kept until :meth:`clear`)."""

    def __init__(self, config: TailConfig, device: jax.Device, seed: int):
        self.config, self.device = config, device
        self.rng = np.random.default_rng(seed)
        latent, hidden = config.latent_size, config.hidden_size
        self.norm_weight = self._put(1 + 0.1 * self.rng.standard_normal(latent, dtype=np.float32))
        # Every block is a slice of one [L, H] kernel: a column block ceil(H / p) is never wider than H.
        self._host_kernel = self.rng.standard_normal((latent, hidden), dtype=np.float32) / np.sqrt(latent)
        self._kernels: dict[int, jax.Array] = {}
        self._activations: dict[tuple[int, int], jax.Array] = {}

    def _put(self, host: np.ndarray) -> jax.Array:
        return jax.device_put(jnp.asarray(host, dtype=self.config.dtype), self.device)

    def kernel(self, columns: int) -> jax.Array:
        if columns not in self._kernels:
            self._kernels[columns] = self._put(self._host_kernel[:, :columns])
        return self._kernels[columns]

    def activation(self, rows: int, columns: int) -> jax.Array:
        if (rows, columns) not in self._activations:
            self._activations[rows, columns] = self._put(self.rng.standard_normal((rows, columns), dtype=np.float32))
        return self._activations[rows, columns]

    def clear(self) -> None:
        self._activations.clear()


def preset_for(device_kind: str) -> str | None:
    """The preset named by ``device_kind`` (DEVICE_KIND_PRESETS), or None."""
    kind = device_kind.upper()
    return next((preset for marker, preset in DEVICE_KIND_PRESETS if marker in kind), None)


def choose_hardware(requested: str | None, device: jax.Device) -> tuple[Hardware | None, str | None]:
    """The preset to compare with (None: none, on the CPU only) and a note to print, or ValueError."""
    detected = None if device.platform == "cpu" else preset_for(device.device_kind)
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


def measure(case: Case, inputs: Inputs, run_jitted, *, repeats: int, warmup: int,
            hardware: Hardware | None) -> dict[str, Any]:
    """Time ``case``'s local work and return its row (module docstring)."""
    config = inputs.config
    arguments = (inputs.activation(case.gemm_rows, config.latent_size), inputs.norm_weight,
                 inputs.kernel(case.columns), inputs.activation(case.gemm_rows, case.columns))
    output, warmup_s, timing = time_runs(functools.partial(run_jitted, *arguments), repeats=repeats, warmup=warmup)
    latent, norm_weight, kernel, shared = (argument.nbytes for argument in arguments)
    bytes_moved = latent + norm_weight + kernel + shared + output.nbytes
    flops = 2 * case.gemm_rows * config.latent_size * case.columns
    flops_per_s, bytes_per_s = flops / timing.median_s, bytes_moved / timing.median_s
    return {
        "tier": case.record.name, "weight_layout": case.weight_layout, "tp_size": case.tp_size,
        "num_tokens": case.num_tokens, "rows": case.rows, "gemm_rows": case.gemm_rows, "gemm_columns": case.columns,
        **dataclasses.asdict(timing), "warmup_s": warmup_s,
        "gemm_flops": flops, "bytes_moved": bytes_moved,
        "bytes": {"latent": latent, "norm_weight": norm_weight, "kernel": kernel, "shared": shared,
                  "output": output.nbytes},
        "tflops_per_s": flops_per_s / 1e12, "gb_per_s": bytes_per_s / 1e9,
        "peak_flops_fraction": None if hardware is None else flops_per_s / hardware.peak_flops,
        "hbm_bandwidth_fraction": None if hardware is None else bytes_per_s / hardware.hbm_bytes_per_s,
    }


def dispatch_floor(device: jax.Device, *, repeats: int, warmup: int) -> Timing:
    """The timing of a jitted one-element add on ``device``: dispatch and launch, no work."""
    one = jax.device_put(jnp.zeros((1,), jnp.float32), device)
    _, _, timing = time_runs(functools.partial(jax.jit(lambda x: x + 1), one), repeats=repeats, warmup=warmup)
    return timing


def three_digits(value: float) -> str:
    """``value`` with about 3 significant digits and no exponent (0.00123, 1.23, 123, 1234)."""
    digits = next((d for d, bound in ((5, 0.01), (4, 0.1), (3, 1), (2, 10), (1, 100)) if value < bound), 0)
    return f"{value:.{digits}f}"


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row, a blank line between (p, T) groups."""
    lines = [f"{'p':>3}{'T':>6}  {'tier':<16}{'layout':<11}{'rows':>6}{'cols':>6}{'median ms':>11}"
             f"{'q25-q75 ms':>19}{'TFLOP/s':>9}{'%peak':>7}{'GB/s':>8}{'%HBM':>7}"]
    previous = None
    for row in rows:
        if previous is not None and (row["tp_size"], row["num_tokens"]) != previous:
            lines.append("")
        previous = row["tp_size"], row["num_tokens"]
        spread = f"{format_ms(row['q25_s'])}-{format_ms(row['q75_s'])}"
        peak, hbm = ("-" if row[key] is None else f"{100 * row[key]:.1f}"
                     for key in ("peak_flops_fraction", "hbm_bandwidth_fraction"))
        lines.append(f"{row['tp_size']:>3}{row['num_tokens']:>6}  {row['tier']:<16}{row['weight_layout']:<11}"
                     f"{row['gemm_rows']:>6}{row['gemm_columns']:>6}{format_ms(row['median_s']):>11}{spread:>19}"
                     f"{three_digits(row['tflops_per_s']):>9}{peak:>7}{three_digits(row['gb_per_s']):>8}{hbm:>7}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp-sizes", type=positive_int_list, default=DEFAULT_TP_SIZES, metavar="P,P,...",
                        help="TP sizes p whose per-rank work to time (default: 4,8)")
    parser.add_argument("--tokens", type=positive_int_list, metavar="T,T,...",
                        help="token counts (default: 1, 2, 4, ... 8192; on the CPU up to 1024)")
    parser.add_argument("--weight-layout", choices=(*WEIGHT_LAYOUTS, "both"), default="both",
                        help="kernel layouts to time each tier with (default: both)")
    parser.add_argument("--repeats", type=positive_int, metavar="N",
                        help=f"timed runs per case (default: {GPU_REPEATS} on a GPU, {CPU_REPEATS} on the CPU)")
    parser.add_argument("--warmup", type=positive_int, default=1, metavar="N",
                        help="untimed runs before them, the first of a new shape compiling (default: 1)")
    parser.add_argument("--hardware", type=str.lower, choices=sorted(HARDWARE),
                        help="cost-model preset whose peaks to compare with (default: from the device kind)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the machine, settings and every row ('-': stdout)")
    add_shape_arguments(parser.add_argument_group("config (default: Kimi-K3)"))
    args = parser.parse_args(argv)

    use_cpu_without_gpu()
    device = jax.devices()[0]
    try:
        hardware, note = choose_hardware(args.hardware, device)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    config = TailConfig.kimi_k3(hidden_size=args.hidden_size, latent_size=args.latent_size, dtype=args.dtype)
    on_cpu = device.platform == "cpu"
    repeats = args.repeats or (CPU_REPEATS if on_cpu else GPU_REPEATS)
    token_counts = args.tokens or default_token_counts(device.platform)
    layouts = WEIGHT_LAYOUTS if args.weight_layout == "both" else (args.weight_layout,)
    todo = cases(config, args.tp_sizes, token_counts, layouts)
    out = sys.stderr if args.json == "-" else sys.stdout

    machine = machine_info()
    print(f"machine: {machine['cpu_count']} x {machine['cpu_model']}, {machine['ram_gib']} GiB RAM; "
          f"python {machine['python']}, jax {machine['jax']}; device {device.platform} {device.device_kind!r}; "
          f"load average (1 min) {machine['load_average_1min']:.2f} at start", file=out)
    print(f"config: H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}; p in "
          f"{','.join(map(str, args.tp_sizes))}; T in {','.join(map(str, token_counts))}; layouts "
          f"{', '.join(layouts)}; {args.warmup} warm-up + {repeats} timed runs each; seed {args.seed}", file=out)
    if hardware is not None:
        print(f"hardware: {hardware.name}, peak {hardware.peak_flops / 1e12:.1f} TFLOP/s (dense BF16), HBM "
              f"{hardware.hbm_bytes_per_s / 1e9:.0f} GB/s", file=out)
    if note is not None:
        print(f"note: {note}", file=out)

    progress("dispatch floor")
    floor = dispatch_floor(device, repeats=repeats, warmup=args.warmup)
    print(f"dispatch floor (jitted one-element add): median {format_ms(floor.median_s)} ms, q25-q75 "
          f"{format_ms(floor.q25_s)}-{format_ms(floor.q75_s)} ms", file=out)

    inputs = Inputs(config, device, args.seed)
    run_jitted = jax.jit(functools.partial(local_work, config=config))
    bar = ProgressBar(len(todo))
    rows, group = [], None
    for case in todo:
        if (case.tp_size, case.num_tokens) != group:
            inputs.clear()
            group = case.tp_size, case.num_tokens
        bar.step(case.label)
        rows.append(measure(case, inputs, run_jitted, repeats=repeats, warmup=args.warmup, hardware=hardware))
    bar.finish()
    inputs.clear()
    load_after = machine_info()["load_average_1min"]

    print(file=out)
    print("\n".join(table_lines(rows)), file=out)
    print(file=out)
    print("rows x cols: one rank's GEMM [rows, L] x [L, cols]; TFLOP/s counts its 2*rows*L*cols FLOPs, GB/s the "
          "bytes of its inputs and output; %peak and %HBM: of the preset's peaks", file=out)
    print(f"load average (1 min) {load_after:.2f} at the end", file=out)
    if args.json:
        report = {
            "machine": machine, "load_average_1min_at_end": load_after,
            "device": {"platform": device.platform, "device_kind": device.device_kind, "id": device.id},
            "settings": {"tp_sizes": list(args.tp_sizes), "tokens": list(token_counts), "weight_layouts": list(layouts),
                         "repeats": repeats, "warmup": args.warmup, "seed": args.seed},
            "config": config_dict(config),
            "hardware": None if hardware is None else dataclasses.asdict(hardware),
            "hardware_note": note,
            "dispatch_floor": dataclasses.asdict(floor),
            "rows": rows,
        }
        if args.json == "-":
            json.dump(report, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            with open(args.json, "w", encoding="utf-8") as stream:
                json.dump(report, stream, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
