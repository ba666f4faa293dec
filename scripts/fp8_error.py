"""What an FP8 up projection costs in accuracy, at Kimi-K3's shapes, on every tier.

    python scripts/fp8_error.py [--devices 8] [--tokens 1,16,256] [--tiers native,...] [--seed 0] [--json FILE]

Inputs (bf16, as the tests draw them, so that the routed and the shared term each carry about half
of y): routed partials randn / sqrt(p) [p, T, L], shared partials randn / sqrt(p) [p, T, H], norm
weight 1 + 0.1 randn [L], kernel randn / sqrt(L) [L, H] (a checkpoint's kernel has its own
distribution: per-column scales follow it, column by column).

For the bf16 kernel and for each FP8 format x fp8_activations, every tier (replicated kernel) runs
``k3_tail.tail_forward`` on a 1-d mesh of --devices CPU devices (all GPUs when there are any), and
its result is compared in float64 (relative Frobenius error) with:

  vs bf16 W      the float64 tail with the unquantised bf16 kernel: what FP8 costs a user;
  vs dequant W   the float64 tail with the quantised kernel's ``dequantize()``: the implementation's
                 own error (bf16 rounding only, for weight-only FP8; plus the per-token activation
                 quantisation with fp8_activations);
  projection     "vs bf16 W" for the routed term alone, y - sum_i s_i against its float64 value.

Prints one row per (format, fp8_activations, T, tier) with progress on stderr; --json FILE writes
the rows. Exit status 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="CPU devices without a GPU (default: 8)")
    parser.add_argument("--tokens", default="1,16,256", help="token counts (default: 1,16,256)")
    parser.add_argument("--tiers", default=None, help="tiers, comma-separated (default: every tier)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    import k3_tail
    from k3_tail.cli.common import use_cpu_without_gpu

    use_cpu_without_gpu()  # keeps a GPU plugin that cannot start quiet, as the k3-tail commands do
    jax.config.update("jax_num_cpu_devices", args.devices)

    devices = jax.devices() if jax.default_backend() != "cpu" else jax.devices("cpu")[: args.devices]
    mesh = jax.make_mesh((len(devices),), ("tp",), devices=devices)
    p = len(devices)
    tiers = [k3_tail.Tier.parse(t) for t in args.tiers.split(",")] if args.tiers else list(k3_tail.Tier)
    base = k3_tail.TailConfig.kimi_k3()
    latent, hidden = base.latent_size, base.hidden_size
    rng = np.random.default_rng(args.seed)

    def bf16(x):
        return jnp.asarray(x, jnp.bfloat16)

    kernel = bf16(rng.standard_normal((latent, hidden), dtype=np.float32) / np.sqrt(latent))
    norm_weight = bf16(1 + 0.1 * rng.standard_normal(latent, dtype=np.float32))
    variants = [(None, False)] + [(f, a) for f in k3_tail.FP8_FORMATS for a in (False, True)]
    rows = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        routed = bf16(rng.standard_normal((p, num_tokens, latent), dtype=np.float32) / np.sqrt(p))
        shared = bf16(rng.standard_normal((p, num_tokens, hidden), dtype=np.float32) / np.sqrt(p))
        normed = _normed_latent(np.asarray(routed, np.float64), np.asarray(norm_weight, np.float64), base.rms_norm_eps)
        shared_sum = np.asarray(shared, np.float64).sum(axis=0)
        exact = normed @ np.asarray(kernel, np.float64)
        for up_proj_dtype, fp8_activations in variants:
            config = k3_tail.TailConfig.kimi_k3(up_proj_dtype=up_proj_dtype, fp8_activations=fp8_activations)
            weights = kernel if up_proj_dtype is None else k3_tail.quantize_up_proj(kernel, up_proj_dtype)
            own = exact if up_proj_dtype is None else normed @ np.asarray(weights.dequantize(), np.float64)
            for tier in tiers:
                print(f"T={num_tokens} {up_proj_dtype or 'bfloat16'} fp8_activations={fp8_activations} {tier.value}",
                      file=sys.stderr, flush=True)
                y = np.asarray(k3_tail.tail_forward(routed, shared, norm_weight, weights, config=config, mesh=mesh,
                                                    tier=tier), np.float64)
                rows.append({
                    "num_tokens": num_tokens, "up_proj_dtype": up_proj_dtype or "bfloat16",
                    "fp8_activations": fp8_activations, "tier": tier.value,
                    "vs_bf16_kernel": _relative(y, exact + shared_sum),
                    "vs_dequantized_kernel": _relative(y, own + shared_sum),
                    "projection_vs_bf16_kernel": _relative(y - shared_sum, exact),
                })
    print(f"Kimi-K3 tail (H={hidden}, L={latent}, bf16 activations), p={p}, {devices[0].platform}; "
          "relative Frobenius errors")
    print(f"{'up_proj_dtype':<17}{'fp8 act':<9}{'T':>5}  {'tier':<16}{'vs bf16 W':>11}{'vs dequant W':>14}"
          f"{'projection':>12}")
    for row in rows:
        print(f"{row['up_proj_dtype']:<17}{str(row['fp8_activations']):<9}{row['num_tokens']:>5}  {row['tier']:<16}"
              f"{row['vs_bf16_kernel']:>11.2e}{row['vs_dequantized_kernel']:>14.2e}"
              f"{row['projection_vs_bf16_kernel']:>12.2e}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"tp_size": p, "platform": devices[0].platform, "rows": rows}, file, indent=2)
    return 0


def _normed_latent(routed: np.ndarray, norm_weight: np.ndarray, eps: float) -> np.ndarray:
    x = routed.sum(axis=0)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * norm_weight


def _relative(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


if __name__ == "__main__":
    sys.exit(main())
