"""Each tier against the native tier and against its bare local GEMM, at Kimi-K3 shapes and one T.

    python scripts/gemm_floor.py [--tokens 1024] [--devices 8] [--repeats 5] [--json FILE]

Method and results: docs/measurements/2026-11-30-gemm-floor.md.
"""

from k3_tail import TailConfig, Tier
from k3_tail.cli.harness import AXIS_NAME, Experiment, positive_int, progress
from k3_tail.cli.tables import format_ms, format_table, median_columns
from k3_tail.tools.benchmark import config_dict, local_gemm_columns, measure_local_gemm, measure_tiers
from lab.blocks import WEIGHT_LAYOUTS


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__, repeats=5)
    experiment.parser.add_argument("--tokens", type=positive_int, default=1024, help="token count T (default: 1024)")
    args = experiment.parse(argv)
    mesh = experiment.mesh()
    tp_size, config, num_tokens = mesh.shape[AXIS_NAME], TailConfig.kimi_k3(), args.tokens
    experiment.print(f"config: Kimi-K3, H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}; "
                     f"T={num_tokens}, p={tp_size}; 1 warm-up + {args.repeats} timed runs each; seed {args.seed}")
    measurements = []
    for layout in WEIGHT_LAYOUTS:
        measurements += measure_tiers(config, mesh, [num_tokens], weight_layout=layout, repeats=args.repeats,
                                      axis_name=AXIS_NAME, seed=args.seed,
                                      on_progress=lambda label: progress(f"tier {label}"))
    floors = {}
    for columns in sorted({local_gemm_columns(m.tier, config, tp_size, m.weight_layout) for m in measurements}):
        for concurrent in (False, True):
            progress(f"GEMM [{num_tokens}, {config.latent_size}] x [{config.latent_size}, {columns}] on "
                     f"{tp_size if concurrent else 1} device(s)")
            floors[columns, concurrent] = measure_local_gemm(
                config, mesh, num_tokens, columns=columns, repeats=args.repeats, concurrent=concurrent,
                axis_name=AXIS_NAME, seed=args.seed)
    native = {m.weight_layout: m.timing.median_s for m in measurements if m.tier is Tier.NATIVE}
    rows = []
    for m in measurements:
        columns = local_gemm_columns(m.tier, config, tp_size, m.weight_layout)
        one, every = floors[columns, False], floors[columns, True]
        rows.append({
            **m.to_dict(), "speedup_vs_native_same_layout": native[m.weight_layout] / m.timing.median_s,
            "speedup_vs_native_replicated": native["replicated"] / m.timing.median_s, "gemm_columns": columns,
            "one_device_gemm_median_s": one.median_s, "over_one_device_gemm": m.timing.median_s / one.median_s,
            "all_devices_gemm_median_s": every.median_s, "over_all_devices_gemm": m.timing.median_s / every.median_s})
    experiment.print("", format_table(rows, [
        ("layout", "<11", lambda r: r["weight_layout"]), ("tier", "<16", lambda r: r["tier"]),
        *median_columns(lambda r: r, (10, 18)),
        ("vs native", ">11", lambda r: f"{r['speedup_vs_native_same_layout']:.2f}x"),
        ("vs repl.", ">10", lambda r: f"{r['speedup_vs_native_replicated']:.2f}x"),
        ("GEMM cols", ">10", lambda r: r["gemm_columns"]),
        ("1-dev ms", ">9", lambda r: format_ms(r["one_device_gemm_median_s"])),
        ("/1-dev", ">8", lambda r: f"{r['over_one_device_gemm']:.2f}x"),
        (f"{tp_size}-dev ms", ">9", lambda r: format_ms(r["all_devices_gemm_median_s"])),
        (f"/{tp_size}-dev", ">8", lambda r: f"{r['over_all_devices_gemm']:.2f}x"),
    ], notes=["", "vs native: over native with the same layout; vs repl.: with the replicated kernel. n-dev ms: the "
              "bare GEMM's median on 1 device or all p at once; /n-dev: the tier's median over it"]))
    return experiment.finish(config=config_dict(config), num_tokens=num_tokens, tp_size=tp_size, rows=rows,
                             gemm_floors=[{"columns": columns, "devices": tp_size if concurrent else 1, **vars(timing)}
                                          for (columns, concurrent), timing in floors.items()])


if __name__ == "__main__":
    raise SystemExit(main())
