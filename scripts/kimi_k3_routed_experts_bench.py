"""The Kimi-K3 layer's time on the CPU mesh with each routed-expert method (k3_tail/models/kimi_k3/routed_experts.py).

    python scripts/kimi_k3_routed_experts_bench.py [--tokens 64,256,1024] [--methods ragged_dot,capacity]
        [--width-divisor 4] [--experts 8] [--top-k 2] [--json FILE]

Method and results: docs/measurements/2026-12-01-routed-experts.md, "On the 8-device CPU mesh".
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k3_tail.cli.harness import Experiment, ProgressBar, choice_list, positive_int, positive_int_list
from k3_tail.cli.tables import format_table, spread_ms
from k3_tail.models.kimi_k3 import LayerConfig, layer as layer_module, partition_specs
from k3_tail.models.kimi_k3.routed_experts import ROUTED_EXPERTS, routed_expert_method
from k3_tail.tools.benchmark import Timing, time_round_robin


def add_layer_arguments(experiment: Experiment) -> None:
    """--width-divisor, --experts and --top-k: the CPU layer's shapes."""
    add = experiment.parser.add_argument
    add("--width-divisor", type=positive_int, default=4, metavar="D",
        help="Kimi-K3's widths H, L, m, F divided by D (default: 4; 1 for the full widths)")
    add("--experts", type=positive_int, default=8, metavar="E", help="routed experts (default: 8)")
    add("--top-k", type=positive_int, default=2, metavar="K", help="experts per token (default: 2)")


def cpu_layer_config(experiment: Experiment, **fields) -> LayerConfig:
    """Kimi-K3's widths / --width-divisor, --experts, --top-k and ``fields``; a usage error unless the
    CPU mesh (--devices) can split it."""
    args = experiment.args
    try:
        config = LayerConfig.kimi_k3(num_experts=args.experts, top_k=args.top_k,
                                     width_divisor=args.width_divisor, **fields)
        partition_specs(config, args.devices)  # the mesh splits m and F by its devices
    except ValueError as error:
        experiment.parser.error(f"--width-divisor, --experts, --top-k: {error}")
    return config


def random_hidden_states(config: LayerConfig, mesh, num_tokens: int, rng: np.random.Generator):
    """Standard normal hidden states [T, H] in the layer's dtype, replicated on ``mesh``."""
    hidden = jnp.asarray(rng.standard_normal((num_tokens, config.hidden_size)), config.dtype)
    return jax.device_put(hidden, NamedSharding(mesh, P()))


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__, repeats=5, warmup=1)
    add = experiment.parser.add_argument
    add("--tokens", type=positive_int_list, default=(64, 256, 1024), metavar="T,...",
        help="token counts (default: 64,256,1024)")
    add("--methods", type=choice_list(tuple(ROUTED_EXPERTS), "methods"), default=("ragged_dot", "capacity"),
        metavar="METHOD,...", help=f"methods of {', '.join(ROUTED_EXPERTS)}, the first the baseline of the speed "
        "column (default: ragged_dot,capacity)")
    add_layer_arguments(experiment)
    args = experiment.parse(argv)
    config = cpu_layer_config(experiment)
    mesh = experiment.mesh(accelerators=False)
    parameters = layer_module.build_layer(config, mesh, seed=args.seed).parameter_values()
    rng = np.random.default_rng(args.seed)
    bar = ProgressBar(len(args.tokens) * (len(args.methods) + args.repeats))
    rows = []
    for num_tokens in args.tokens:
        hidden = random_hidden_states(config, mesh, num_tokens, rng)
        calls = {method: functools.partial(layer_module.layer_forward, parameters, hidden,
                                           config=cpu_layer_config(experiment, routed_experts=method), mesh=mesh)
                 for method in args.methods}
        seconds = time_round_robin(calls, rounds=args.repeats, warmup=args.warmup,
                                   on_progress=lambda message, tokens=num_tokens: bar.step(f"T={tokens}: {message}"))
        selected = routed_expert_method(config, num_tokens).method
        baseline = float(np.median(seconds[args.methods[0]]))
        for method in args.methods:
            timing = Timing.of(seconds[method])
            rows.append({"num_tokens": num_tokens, "method": method, "selected": method == selected,
                         "layer_s": timing, "speed_vs_first": baseline / timing.median_s})
    bar.finish()
    experiment.print(
        f"the layer on {mesh.size} CPU devices: H={config.hidden_size}, L={config.latent_size}, "
        f"m={config.expert_intermediate_size}, F={config.shared_intermediate_size} (Kimi-K3 / {args.width_divisor}), "
        f"{config.num_experts} experts, top {config.top_k}, {config.dtype.name}, replicated up projection; "
        f"{args.warmup} warm-up + {args.repeats} rounds", format_table(rows, [
            ("T", ">6", lambda r: r["num_tokens"]), ("", "2", lambda r: ""),
            ("method", "<13", lambda r: r["method"] + (" *" if r["selected"] else "")),
            ("layer ms (q25-q75)", ">26", lambda r: spread_ms(r["layer_s"])),
            (f"vs {args.methods[0]}", ">16", lambda r: f"{r['speed_vs_first']:.2f}x"),
        ], group=lambda r: r["num_tokens"],
            notes=["* the method the layer selects for that T; vs: the first method's median over this one's"]))
    return experiment.finish(rows=rows)


if __name__ == "__main__":
    raise SystemExit(main())
