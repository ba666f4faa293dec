"""What an FP8 up projection costs in accuracy, at Kimi-K3's shapes, on every tier.

    python scripts/fp8_error.py [--devices 8] [--tokens 1,16,256] [--tiers native,...] [--seed 0] [--json FILE]

Method and results: docs/measurements/2026-11-30-fp8-up-projection.md.
"""

import numpy as np

import k3_tail
from k3_tail.cli.harness import AXIS_NAME, Experiment, positive_int_list, progress, tier_list
from k3_tail.cli.tables import format_table
from lab.accuracy import random_partials, random_weights, reference_latent, relative_error
from lab.blocks import FP8_FORMATS


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__)
    add = experiment.parser.add_argument
    add("--tokens", type=positive_int_list, default=(1, 16, 256), metavar="T,T,...",
        help="token counts (default: 1,16,256)")
    add("--tiers", type=tier_list, default=tuple(k3_tail.Tier), metavar="TIER,...",
        help="tiers, comma-separated (default: every tier)")
    args = experiment.parse(argv)
    mesh = experiment.mesh()
    p = mesh.shape[AXIS_NAME]
    base = k3_tail.TailConfig.kimi_k3()
    rng = np.random.default_rng(args.seed)
    norm_weight, kernel = random_weights(base, rng)
    variants = [(None, False)] + [(name, fp8) for name in FP8_FORMATS for fp8 in (False, True)]
    rows = []
    for num_tokens in args.tokens:
        routed, shared = random_partials(base, p, num_tokens, rng)
        normed = reference_latent(base, routed, norm_weight)
        shared_sum = shared.astype(np.float64).sum(axis=0)
        exact = normed @ kernel.astype(np.float64)
        for up_proj_dtype, fp8_activations in variants:
            config = k3_tail.TailConfig.kimi_k3(up_proj_dtype=up_proj_dtype, fp8_activations=fp8_activations)
            weights = kernel if up_proj_dtype is None else k3_tail.quantize_up_proj(kernel, up_proj_dtype)
            own = exact if up_proj_dtype is None else normed @ np.asarray(weights.dequantize(), np.float64)
            for tier in args.tiers:
                progress(f"T={num_tokens} {up_proj_dtype or 'bfloat16'} fp8_activations={fp8_activations} {tier.value}")
                y = np.asarray(k3_tail.tail_forward(routed, shared, norm_weight, weights, config=config, mesh=mesh,
                                                    tier=tier), np.float64)
                rows.append({
                    "num_tokens": num_tokens, "up_proj_dtype": up_proj_dtype or "bfloat16",
                    "fp8_activations": fp8_activations, "tier": tier.value,
                    "vs_bf16_kernel": relative_error(y, exact + shared_sum),
                    "vs_dequantized_kernel": relative_error(y, own + shared_sum),
                    "projection_vs_bf16_kernel": relative_error(y - shared_sum, exact),
                })
    experiment.print(f"Kimi-K3 tail (H={base.hidden_size}, L={base.latent_size}, bf16 activations), p={p}, "
                     f"{mesh.devices.flat[0].platform}; relative Frobenius errors", format_table(rows, [
                         ("up_proj_dtype", "<17", lambda r: r["up_proj_dtype"]),
                         ("fp8 act", "<9", lambda r: str(r["fp8_activations"])), ("T", ">5", lambda r: r["num_tokens"]),
                         ("", "2", lambda r: ""), ("tier", "<16", lambda r: r["tier"]),
                         ("vs bf16 W", ">11.2e", lambda r: r["vs_bf16_kernel"]),
                         ("vs dequant W", ">14.2e", lambda r: r["vs_dequantized_kernel"]),
                         ("projection", ">12.2e", lambda r: r["projection_vs_bf16_kernel"])]))
    return experiment.finish(tp_size=p, platform=mesh.devices.flat[0].platform, rows=rows)


if __name__ == "__main__":
    raise SystemExit(main())
