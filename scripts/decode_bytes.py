"""What one tail call moves per device at decode, per tier, from the compiled GPU program.

    python scripts/decode_bytes.py [--topology h100x8] [--tokens 1,2,16] [--format float8_e4m3fn]
                                   [--variants bf16,fp8,fp8+act] [--json FILE]

Compiles the Kimi-K3 tail (``k3_tail.compile_tail``, with the library's compiler options) for a
deviceless GPU topology (no GPU needed; the ``[aot]`` extra) for every tier and weight layout it runs
with, at each T, with the kernel in bf16 ("bf16"), in FP8 ("fp8", weight-only) and in FP8 with FP8
activations ("fp8+act"). Per device it prints:

  MB accessed   ``k3_tail.xla_report``'s bytes accessed: the operand and result bytes of every
                top-level instruction of the program (a GEMM that reads its kernel once counts it once;
                a copy of the kernel, or a float32 product the size of the kernel, counts again);
  x T=2         that figure against the same tier's at T = 2 (a one-row GEMM should cost no more);
  temp MB       XLA's memory analysis: the temporary buffers the program needs beside its arguments
                and result (a copy of a kernel block shows here);
  GEMMs         the number of instructions that run a GEMM (0: XLA rewrote the product into a
                multiply and a reduce).

Progress on stderr; --json FILE writes the rows. Exit status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_VARIANTS = {"bf16": {}, "fp8": {"up_proj_dtype": None}, "fp8+act": {"up_proj_dtype": None, "fp8_activations": True}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="h100x8")
    parser.add_argument("--tokens", default="1,2,16")
    parser.add_argument("--format", default="float8_e4m3fn", help="FP8 format (default: float8_e4m3fn)")
    parser.add_argument("--variants", default="bf16,fp8,fp8+act", help=f"of {','.join(_VARIANTS)}")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(_VARIANTS):
        parser.error(f"--variants: expected names of {','.join(_VARIANTS)}, got {args.variants!r}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a deviceless compile; keeps the CUDA plugin quiet

    import k3_tail

    mesh = k3_tail.topology_mesh(args.topology)
    cases = [(tier, layout, variant, int(tokens)) for tier in k3_tail.Tier for layout in k3_tail.WEIGHT_LAYOUTS
             if tier.supports(layout) for variant in variants for tokens in args.tokens.split(",")]
    rows = []
    for tier, layout, variant, num_tokens in cases:
        print(f"{tier.value} {layout} {variant} T={num_tokens}", file=sys.stderr, flush=True)
        fields = {name: args.format if value is None else value for name, value in _VARIANTS[variant].items()}
        compiled = k3_tail.compile_tail(k3_tail.TailConfig.kimi_k3(**fields), mesh, num_tokens, tier=tier,
                                        weight_layout=layout)
        report = k3_tail.xla_report.report(compiled)
        rows.append({"tier": tier.value, "weight_layout": layout, "variant": variant, "num_tokens": num_tokens,
                     "bytes_accessed": report.bytes_accessed, "gemms": len(report.gemms),
                     "temp_bytes": compiled.memory_analysis().temp_size_in_bytes})
    two = {(r["tier"], r["weight_layout"], r["variant"]): r["bytes_accessed"] for r in rows if r["num_tokens"] == 2}
    print(f"Kimi-K3 tail on {args.topology} (deviceless compile), per device")
    print(f"{'tier':<16}{'layout':<12}{'weights':<9}{'T':>5}{'MB accessed':>13}{'x T=2':>7}{'temp MB':>9}{'GEMMs':>7}")
    for row in rows:
        key = (row["tier"], row["weight_layout"], row["variant"])
        ratio = f"{row['bytes_accessed'] / two[key]:.2f}" if key in two else "-"
        print(f"{row['tier']:<16}{row['weight_layout']:<12}{row['variant']:<9}{row['num_tokens']:>5}"
              f"{row['bytes_accessed'] / 1e6:>13.2f}{ratio:>7}{row['temp_bytes'] / 1e6:>9.2f}{row['gemms']:>7}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"topology": args.topology, "rows": rows}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
