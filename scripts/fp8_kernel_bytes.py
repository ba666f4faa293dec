"""The kernel bytes each tier's GEMM reads per device, bf16 against FP8, from the compiled GPU program.

    python scripts/fp8_kernel_bytes.py [--topology h100x8] [--tokens 1,16,2048] [--format float8_e4m3fn]
                                       [--json FILE]

Compiles the Kimi-K3 tail (``k3_tail.compile_tail``, with the library's compiler options) for a
deviceless GPU topology (no GPU needed; the ``[aot]`` extra) for every tier and weight layout it runs
with, at each T, three ways: the kernel in bf16, FP8 weights (``up_proj_dtype=--format``) and FP8
weights with FP8 activations. From ``k3_tail.xla_report`` it prints per device:

  kernel MB     the bytes of the kernel argument(s) each device holds (FP8: values + float32 scales);
  GEMM reads    the element types of the arrays the GEMM instruction(s) read;
  kernel read   the MB of the kernel (or this rank's block of it) that they read: their operands of
                L x H or L x H/p elements, float32 products excluded (for one token XLA may compute
                the product as a multiply that writes float32 [L, H/p] and a reduce that reads it);
  overlapped    whether the shared reduction runs async beside the GEMM.

Progress on stderr; --json FILE writes the rows. Exit status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="h100x8")
    parser.add_argument("--tokens", default="1,16,2048")
    parser.add_argument("--format", default="float8_e4m3fn", help="FP8 format (default: float8_e4m3fn)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a deviceless compile; keeps the CUDA plugin quiet

    import k3_tail

    mesh = k3_tail.topology_mesh(args.topology)
    variants = {"bf16": {}, "fp8": {"up_proj_dtype": args.format},
                "fp8+act": {"up_proj_dtype": args.format, "fp8_activations": True}}
    rows = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        for tier in k3_tail.Tier:
            for layout in k3_tail.WEIGHT_LAYOUTS:
                if not tier.supports(layout):
                    continue
                for variant, fields in variants.items():
                    print(f"T={num_tokens} {tier.value} {layout} {variant}", file=sys.stderr, flush=True)
                    config = k3_tail.TailConfig.kimi_k3(**fields)
                    compiled = k3_tail.compile_tail(config, mesh, num_tokens, tier=tier, weight_layout=layout)
                    report = k3_tail.xla_report.report(compiled)
                    kernel_arguments = report.arguments[-2:] if fields else report.arguments[-1:]
                    operands = [array for gemm in report.gemms for array in gemm.operands]
                    kernel_elements = {config.latent_size * config.hidden_size,
                                       config.latent_size * config.hidden_size // mesh.shape["tp"]}
                    rows.append({
                        "num_tokens": num_tokens, "tier": tier.value, "weight_layout": layout, "variant": variant,
                        "kernel_bytes": sum(array.bytes for array in kernel_arguments),
                        "gemm_operand_types": sorted({array.dtype for array in operands}),
                        "gemm_kernel_bytes": sum(array.bytes for array in operands
                                                 if array.elements in kernel_elements and array.dtype != "f32"),
                        "overlapped": report.overlapped,
                    })
    print(f"Kimi-K3 tail on {args.topology} (deviceless compile), per device")
    print(f"{'T':>5}  {'tier':<16}{'layout':<12}{'weights':<9}{'kernel MB':>10}  {'GEMM reads':<26}"
          f"{'kernel read MB':>15}  overlapped")
    for row in rows:
        print(f"{row['num_tokens']:>5}  {row['tier']:<16}{row['weight_layout']:<12}{row['variant']:<9}"
              f"{row['kernel_bytes'] / 1e6:>10.3f}  {', '.join(row['gemm_operand_types']):<26}"
              f"{row['gemm_kernel_bytes'] / 1e6:>15.3f}  {row['overlapped']}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"topology": args.topology, "rows": rows}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
