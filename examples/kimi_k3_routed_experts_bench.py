"""The Kimi-K3 layer's time on the CPU mesh with each routed-expert method (examples/kimi_k3_routed_experts.py).

    python scripts/routed_experts_bench.py [--tokens 64,256,1024] [--methods ragged_dot,capacity] [--repeats 5]
                                           [--warmup 1] [--width-divisor 4] [--experts 8] [--top-k 2] [--seed 0]
                                           [--json FILE]

The layer is :class:`KimiK3MoELayer` on 8 CPU devices with stand-in weights at Kimi-K3's widths divided
by --width-divisor (default 4: H 1792, L 896, m 768, F 1536, as scripts/layer_share.py's cpu part),
--experts / --top-k (8 / 2), bf16, the up projection replicated, the tail tier it selects. Per T, the
same hidden states go through the layer once per method of --methods (default: ragged_dot, the
layer's method above T*k = E before, and capacity, its method now): each program compiled and run
--warmup times, then timed in --repeats rounds, each round running every method once (the order rotating),
each run timed with perf_counter around the call and block_until_ready
(:func:`k3_tail.benchmark.time_round_robin`). Reported: median and q25-q75
in ms and the speed against the first method (its median over the method's); * marks the method the
layer selects for that T.

Each method is forced with ``LayerConfig(routed_experts=method)`` on the same parameters (one
program per method). The 8 CPU devices share the host's cores, and ragged_dot runs densely over the
E experts on CPU: this ranks the methods on this machine only.

Progress on stderr; --json FILE also writes the machine, the settings and every row. Exit status 0,
or 2 for bad arguments.
"""

# ruff: noqa: E402  (the platform is chosen, and the repository put on the path, before jax and examples load)

import os
import sys
from pathlib import Path

# Without a GPU the CUDA plugin of the [aot] extra would print a cuDNN traceback when jax starts its backends.
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root holds examples/

import argparse
import dataclasses
import functools
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples import kimi_k3_moe_layer as layer_module
from examples.kimi_k3_routed_experts import ROUTED_EXPERTS, routed_expert_method
from k3_tail import benchmark
from k3_tail.cli.common import ProgressBar, announce_machine, choice_list, format_ms, positive_int, positive_int_list

CPU_DEVICES = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="The Kimi-K3 layer's time on the CPU mesh per routed-expert "
                                     "method, interleaved. See the module docstring.")
    parser.add_argument("--tokens", type=positive_int_list, default=(64, 256, 1024), metavar="T,...",
                        help="token counts (default: 64,256,1024)")
    parser.add_argument("--methods", type=choice_list(tuple(ROUTED_EXPERTS), "methods"),
                        default=("ragged_dot", "capacity"), metavar="METHOD,...",
                        help=f"methods of {', '.join(ROUTED_EXPERTS)}, the first the baseline of the speed column "
                             "(default: ragged_dot,capacity)")
    parser.add_argument("--repeats", type=positive_int, default=5, metavar="N", help="timed rounds per T (default: 5)")
    parser.add_argument("--warmup", type=positive_int, default=1, metavar="N",
                        help="untimed runs of each program first (default: 1)")
    parser.add_argument("--width-divisor", type=positive_int, default=4, metavar="D",
                        help="Kimi-K3's widths H, L, m, F divided by D (default: 4; 1 for the full widths)")
    parser.add_argument("--experts", type=positive_int, default=8, metavar="E", help="routed experts (default: 8)")
    parser.add_argument("--top-k", type=positive_int, default=2, metavar="K", help="experts per token (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stand-in weights and inputs")
    parser.add_argument("--json", metavar="FILE", help="also write the machine, the settings and every row")
    args = parser.parse_args(argv)
    try:
        layer_module.partition_specs(layer_config(args), CPU_DEVICES)  # the mesh splits m and F by its devices
    except ValueError as error:
        parser.error(f"--width-divisor, --experts, --top-k: {error}")
    return args


def layer_config(args: argparse.Namespace, routed_experts: str | None = None) -> layer_module.LayerConfig:
    """Kimi-K3's widths / --width-divisor, --experts, --top-k; the routed-expert method forced, or selected."""
    return layer_module.LayerConfig.kimi_k3(num_experts=args.experts, top_k=args.top_k,
                                            width_divisor=args.width_divisor, routed_experts=routed_experts)


def measure(args: argparse.Namespace) -> tuple[layer_module.LayerConfig, list[dict[str, Any]]]:
    """One row per (T, method): the layer's timing on the CPU mesh (module docstring)."""
    config = layer_config(args)
    mesh = jax.make_mesh((CPU_DEVICES,), ("tp",), devices=jax.devices("cpu")[:CPU_DEVICES])
    parameters = layer_module.build_layer(config, mesh, seed=args.seed).parameter_values()
    rng = np.random.default_rng(args.seed)
    bar = ProgressBar(len(args.tokens) * (len(args.methods) + args.repeats))
    rows = []
    for num_tokens in args.tokens:
        hidden = jax.device_put(jnp.asarray(rng.standard_normal((num_tokens, config.hidden_size)), config.dtype),
                                NamedSharding(mesh, P()))
        calls = {method: functools.partial(layer_module.layer_forward, parameters, hidden,
                                           config=layer_config(args, method), mesh=mesh)
                 for method in args.methods}
        for _ in range(args.warmup - 1):  # time_round_robin runs each once before timing
            for call in calls.values():
                call().block_until_ready()
        seconds = benchmark.time_round_robin(calls, rounds=args.repeats,
                                             on_progress=lambda message, tokens=num_tokens: bar.step(
                                                 f"T={tokens}: {message}"))
        selected = routed_expert_method(config, num_tokens).method
        baseline = float(np.median(seconds[args.methods[0]]))
        for method in args.methods:
            timing = benchmark.Timing.of(seconds[method])
            rows.append({"num_tokens": num_tokens, "method": method, "selected": method == selected,
                         "layer_s": dataclasses.asdict(timing), "speed_vs_first": baseline / timing.median_s})
    bar.finish()
    return config, rows


def format_rows(config: layer_module.LayerConfig, rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"the layer on {CPU_DEVICES} CPU devices: H={config.hidden_size}, L={config.latent_size}, "
        f"m={config.expert_intermediate_size}, F={config.shared_intermediate_size} (Kimi-K3 / {args.width_divisor}), "
        f"{config.num_experts} experts, top {config.top_k}, {config.dtype.name}, replicated up projection; "
        f"{args.warmup} warm-up + {args.repeats} rounds",
        f"{'T':>6}  {'method':<13}{'layer ms (q25-q75)':>26}{f'vs {args.methods[0]}':>16}",
    ]
    for index, row in enumerate(rows):
        if index and row["num_tokens"] != rows[index - 1]["num_tokens"]:
            lines.append("")
        timing = row["layer_s"]
        spread = f"{format_ms(timing['median_s'])} ({format_ms(timing['q25_s'])}-{format_ms(timing['q75_s'])})"
        name = row["method"] + (" *" if row["selected"] else "")
        lines.append(f"{row['num_tokens']:>6}  {name:<13}{spread:>26}{row['speed_vs_first']:>15.2f}x")
    lines.append("* the method the layer selects for that T; vs: the first method's median over this one's")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
    started = time.perf_counter()
    machine = announce_machine()
    config, rows = measure(args)
    elapsed = time.perf_counter() - started
    print(format_rows(config, rows, args))
    print(f"\nelapsed {elapsed:.0f} s; load average {os.getloadavg()[0]:.2f} at end")
    if args.json:
        settings = {name: value for name, value in vars(args).items() if name != "json"}
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"machine": machine, "settings": settings, "elapsed_s": elapsed, "rows": rows}, file, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
