"""Each tier against the native tier and against its bare local GEMM, at Kimi-K3 shapes and one T.

    python scripts/gemm_floor.py [--tokens 1024] [--devices 8] [--repeats 5] [--json FILE]

times every tier with both weight layouts (k3_tail.tools.benchmark.measure_tiers) on a TP mesh of all
accelerators, or of --devices forced CPU devices without one, then the bare local GEMM each tier's
rank runs, [T, L] x [L, columns] (k3_tail.tools.benchmark.measure_local_gemm) with columns = H/p for the
tiers that project their own column block and H for those that project all columns
(k3_tail.tools.benchmark.local_gemm_columns), twice:

  1 device: on one device alone, the floor of one rank's compute when ranks have their own hardware;
  p devices: every device of the mesh running its own such GEMM at once, the floor of the whole TP
    step when the devices share hardware, as forced CPU devices share the host's cores.

It prints, per (layout, tier): the median and quartiles, the speedup over native with the same
layout and over native with the replicated kernel (vLLM's layout), and the tier's median over each
GEMM floor's median. docs/performance.md records a run. Exit status 0, or 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax

from k3_tail import WEIGHT_LAYOUTS, TailConfig, Tier
from k3_tail.tools.benchmark import (
    config_dict, local_gemm_columns, machine_info, measure_local_gemm, measure_tiers,
)
from k3_tail.cli.common import CommandError, demo_devices, format_ms, positive_int, progress, use_cpu_without_gpu

AXIS_NAME = "tp"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=1024, help="token count T (default: 1024)")
    parser.add_argument("--devices", type=positive_int, default=8,
                        help="CPU devices to make without an accelerator (default: 8)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs of each (default: 5)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the machine, the measurements and the floors")
    args = parser.parse_args(argv)
    use_cpu_without_gpu()
    try:
        devices = demo_devices(args.devices)
    except CommandError as error:
        print(f"gemm_floor.py: error: {error}", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((len(devices),), (AXIS_NAME,), devices=devices)
    tp_size = len(devices)
    config = TailConfig.kimi_k3()
    num_tokens = args.tokens
    machine = machine_info()
    print(f"machine: {machine['cpu_count']} x {machine['cpu_model']}, {machine['ram_gib']} GiB RAM; "
          f"python {machine['python']}, jax {machine['jax']}; {tp_size} {devices[0].platform} devices; "
          f"load average (1 min) {machine['load_average_1min']:.2f} at start")
    print(f"config: Kimi-K3, H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}; T={num_tokens}, "
          f"p={tp_size}; 1 warm-up + {args.repeats} timed runs each; seed {args.seed}")

    def on_progress(label: str) -> None:
        progress(f"tier {label}")

    measurements = []
    for layout in WEIGHT_LAYOUTS:
        measurements += measure_tiers(config, mesh, [num_tokens], weight_layout=layout, repeats=args.repeats,
                                      axis_name=AXIS_NAME, seed=args.seed, on_progress=on_progress)
    floors = {}
    for columns in sorted({local_gemm_columns(m.tier, config, tp_size, m.weight_layout) for m in measurements}):
        for concurrent in (False, True):
            progress(f"GEMM [{num_tokens}, {config.latent_size}] x [{config.latent_size}, {columns}] on "
                     f"{tp_size if concurrent else 1} device(s)")
            floors[columns, concurrent] = measure_local_gemm(
                config, mesh, num_tokens, columns=columns, repeats=args.repeats, concurrent=concurrent,
                axis_name=AXIS_NAME, seed=args.seed,
            )
    load_after = machine_info()["load_average_1min"]

    native = {m.weight_layout: m.timing.median_s for m in measurements if m.tier is Tier.NATIVE}
    print()
    print(f"{'layout':<11}{'tier':<16}{'median ms':>10}{'q25-q75 ms':>18}{'vs native':>10}{'vs native':>10}"
          f"{'GEMM':>6}{'1-dev':>9}{'tier /':>8}{f'{tp_size}-dev':>9}{'tier /':>8}")
    print(f"{'':<11}{'':<16}{'':>10}{'':>18}{'(layout)':>10}{'(repl.)':>10}"
          f"{'cols':>6}{'GEMM ms':>9}{'1-dev':>8}{'GEMM ms':>9}{f'{tp_size}-dev':>8}")
    rows = []
    for m in measurements:
        columns = local_gemm_columns(m.tier, config, tp_size, m.weight_layout)
        one, every = floors[columns, False], floors[columns, True]
        row = {
            **m.to_dict(), "speedup_vs_native_same_layout": native[m.weight_layout] / m.timing.median_s,
            "speedup_vs_native_replicated": native["replicated"] / m.timing.median_s, "gemm_columns": columns,
            "one_device_gemm_median_s": one.median_s, "over_one_device_gemm": m.timing.median_s / one.median_s,
            "all_devices_gemm_median_s": every.median_s, "over_all_devices_gemm": m.timing.median_s / every.median_s,
        }
        rows.append(row)
        spread = f"{format_ms(m.timing.q25_s)}-{format_ms(m.timing.q75_s)}"
        print(f"{m.weight_layout:<11}{m.tier.value:<16}{format_ms(m.timing.median_s):>10}{spread:>18}"
              f"{row['speedup_vs_native_same_layout']:>9.2f}x{row['speedup_vs_native_replicated']:>9.2f}x"
              f"{columns:>6}{format_ms(one.median_s):>9}{row['over_one_device_gemm']:>7.2f}x"
              f"{format_ms(every.median_s):>9}{row['over_all_devices_gemm']:>7.2f}x")
    print()
    print(f"load average (1 min) {load_after:.2f} at the end")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as stream:
            json.dump({
                "machine": machine, "load_average_1min_at_end": load_after, "config": config_dict(config),
                "num_tokens": num_tokens, "tp_size": tp_size, "repeats": args.repeats, "seed": args.seed,
                "rows": rows,
                "gemm_floors": [
                    {"columns": columns, "devices": tp_size if concurrent else 1, **dataclasses.asdict(timing)}
                    for (columns, concurrent), timing in floors.items()
                ],
            }, stream, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
