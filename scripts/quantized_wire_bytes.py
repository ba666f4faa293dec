"""What quantised sums move per device, per tier, from the compiled GPU program.

    python scripts/quantized_wire_bytes.py [--topology h100x8] [--tokens 16,2048] [--json FILE]

Compiles the Kimi-K3 tail (``k3_tail.compile_tail``, with the library's compiler options) for a
deviceless GPU topology (no GPU needed; the ``[aot]`` extra), for every tier on the replicated kernel
(which every tier runs with), at each T, with bf16 sums and with each codec, every sum quantised
(minimum size 0) and with vLLM's default minimum sizes. Per device it prints the ring wire bytes of
all the program's collectives (``k3_tail.xla_report``: (g-1)/g of each all-to-all's send buffer and
all-gather's result, 2(g-1)/g of each all-reduce's buffer), their ratio to the bf16 program's, and
the collectives' forms and payload types.

Progress on stderr; --json FILE writes the rows. Exit status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_MINIMA = {"every sum": 0, "vLLM minimum": None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="h100x8")
    parser.add_argument("--tokens", default="16,2048")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a deviceless compile; keeps the CUDA plugin quiet

    import k3_tail
    from k3_tail.ops.codecs import CODECS

    mesh = k3_tail.topology_mesh(args.topology)
    variants = [("bf16", None, None)] + [(codec, codec, minimum) for codec in CODECS for minimum in _MINIMA.values()]
    rows = []
    for num_tokens in (int(tokens) for tokens in args.tokens.split(",")):
        for tier in k3_tail.Tier:
            plain = None
            for label, codec, minimum in variants:
                print(f"{tier.value} {label} min={minimum} T={num_tokens}", file=sys.stderr, flush=True)
                config = k3_tail.TailConfig.kimi_k3(all_reduce_quantization=codec,
                                                    quantized_all_reduce_min_bytes=minimum)
                report = k3_tail.xla_report.report(
                    k3_tail.compile_tail(config, mesh, num_tokens, tier=tier, weight_layout="replicated"))
                wire = sum(c.wire_bytes for c in report.collectives)
                plain = wire if codec is None else plain
                forms = sorted(f"{c.form} {'+'.join(c.payload_dtypes)}" for c in report.collectives)
                rows.append({"tier": tier.value, "num_tokens": num_tokens, "codec": label,
                             "sums": "-" if codec is None else next(k for k, v in _MINIMA.items() if v == minimum),
                             "wire_bytes": wire, "ratio": wire / plain, "forms": forms})

    print(f"\nring wire bytes per device, Kimi-K3, replicated kernel, {args.topology}\n")
    print(f"| {'tier':<15}| {'T':>5} | {'codec':<5} | {'sums':<12} | {'wire MB':>8} | {'x bf16':>7} | collectives")
    print("| --- | ---: | --- | --- | ---: | ---: | --- |")
    for row in rows:
        print(f"| {row['tier']:<15}| {row['num_tokens']:>5} | {row['codec']:<5} | {row['sums']:<12} | "
              f"{row['wire_bytes'] / 1e6:>8.2f} | {row['ratio']:>7.3f} | {', '.join(row['forms'])}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
