"""Decode steps of a Kimi-K3 latent MoE layer on 8 CPU devices, checked against the float64 reference.

    python examples/kimi_k3_decode.py [--tokens 1,16] [--width-divisor 16] [--experts 8] [--top-k 2]

Builds the layer with random stand-in weights at Kimi-K3's proportions (widths divided by --width-divisor),
runs one call per token count, and prints the tail tier the call takes (and why) and y's relative error
against the float64 numpy reference. On a GPU host, run it with JAX_PLATFORMS unset to use the GPUs.
"""

import argparse
import os

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--tokens", default="1,16", help="token counts, comma-separated (default: 1,16)")
parser.add_argument("--width-divisor", type=int, default=16, help="divide Kimi-K3's widths by this (default: 16)")
parser.add_argument("--experts", type=int, default=8, help="routed experts (default: 8; Kimi-K3 has 896)")
parser.add_argument("--top-k", type=int, default=2, help="experts per token (default: 2; Kimi-K3 routes to 16)")


def main(argv: list[str] | None = None) -> int:
    args = parser.parse_args(argv)
    try:
        token_counts = [int(count) for count in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens: expected integers separated by commas, got {args.tokens!r}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import numpy as np

    from k3_tail.models.kimi_k3 import LayerConfig, build_layer, random_checkpoint, reference_layer

    try:
        config = LayerConfig.kimi_k3(num_experts=args.experts, top_k=args.top_k, width_divisor=args.width_divisor)
    except ValueError as error:
        parser.error(str(error))
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    layer = build_layer(config, mesh, seed=0)
    weights = random_checkpoint(config, seed=0)
    for num_tokens in token_counts:
        x = np.random.default_rng(num_tokens).standard_normal((num_tokens, config.hidden_size)).astype(config.dtype)
        y = np.asarray(layer(x), np.float64)
        expected = reference_layer(weights, x, top_k=config.top_k, rms_norm_eps=config.tail.rms_norm_eps,
                                   routed_scaling_factor=config.tail.routed_scaling_factor)
        error = np.linalg.norm(y - expected) / np.linalg.norm(expected)
        print(f"T = {num_tokens}: {layer.plan(num_tokens)}\n  y's relative error against float64: {error:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
