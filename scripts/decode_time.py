"""Every tier at decode token counts, T = 1, 2 and 16, in one interleaved run on this machine's mesh.

    python scripts/decode_time.py [--tokens 1,2,16] [--devices 8] [--rounds 7] [--json FILE]

A one-row GEMM should cost no more than a two-row one. The library multiplies a single row as two
(:func:`k3_tail.ops.up_projection.project`); this script checks that where it matters, and shows
the cliff it avoids:

tiers    ``k3_tail.tail_forward`` of the Kimi-K3 tail (bf16) by every tier with each weight layout
         it runs with, at each T.
gemm     the bare rank-local GEMM [T, L] x [L, H/p] in a ``jax.shard_map`` over the mesh (every rank
         at once, the column block each column-layout rank holds): as the library computes it
         (``project``) and as a plain ``jnp.dot`` of T rows, which for T = 1 is what XLA got before.

Timing: a 1-d TP mesh (all GPUs, or --devices forced CPU devices); inputs placed first; every
call runs once to compile, then --rounds rounds each run every call once, the order rotating
(:func:`k3_tail.benchmark.time_round_robin`). Reported per call: the median and quartiles in ms
and its median over the same call's at T = 2 ("x T=2"; at most about 1 where one row costs no
more than two).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3_tail import TailConfig, Tier, tail_forward
from k3_tail.cli.common import (
    AXIS_NAME, CommandError, add_timing_arguments, format_ms, positive_int_list, progress, timing_mesh,
)
from k3_tail.ops.up_projection import project
from k3_tail.tools.benchmark import Timing, machine_info, place_partials, place_weights, time_round_robin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int_list, default=(1, 2, 16), metavar="T,T,...",
                        help="token counts, 2 among them (default: 1,2,16)")
    add_timing_arguments(parser, rounds=7)
    args = parser.parse_args(argv)
    if 2 not in args.tokens:
        parser.error("--tokens: expected 2 among the token counts (the ratios are taken against T = 2)")
    try:
        mesh, machine = timing_mesh(args.devices)
    except CommandError as error:
        print(f"decode_time.py: error: {error}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    kimi = TailConfig.kimi_k3()
    weights = {layout: place_weights(kimi, mesh, layout, rng) for layout in ("column", "replicated")}
    calls = {}
    for num_tokens in args.tokens:
        routed, shared = place_partials(kimi, mesh, num_tokens, rng)
        for tier in Tier:
            for layout in ("column", "replicated"):
                if tier.supports(layout):
                    calls["tiers", tier.value, layout, num_tokens] = functools.partial(
                        tail_forward, routed, shared, *weights[layout], config=kimi, mesh=mesh, tier=tier,
                        weight_layout=layout)
        latent = jax.device_put(routed, NamedSharding(mesh, P(AXIS_NAME)))
        for form, gemm in (("project", _project_block), ("jnp.dot", _dot_block)):
            calls["gemm", form, "column", num_tokens] = functools.partial(gemm, latent, weights["column"][1], mesh)
    seconds = time_round_robin(calls, rounds=args.rounds, on_progress=progress)
    rows = [{"part": part, "name": name, "weight_layout": layout, "num_tokens": num_tokens,
             **dataclasses.asdict(Timing.of(runs)), "seconds": runs}
            for (part, name, layout, num_tokens), runs in seconds.items()]
    two = {(r["part"], r["name"], r["weight_layout"]): r["median_s"] for r in rows if r["num_tokens"] == 2}
    for row in rows:
        row["vs_two_rows"] = row["median_s"] / two[row["part"], row["name"], row["weight_layout"]]
    print_table(rows)
    print(f"load average {machine_info()['load_average_1min']:.2f} at the end")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as stream:
            json.dump({"machine": machine, "rounds": args.rounds, "rows": rows}, stream, indent=2)
    return 0


@functools.partial(jax.jit, static_argnums=2)
def _project_block(routed, kernel, mesh):
    """Each rank's [T, L] x [L, H/p] as the tiers compute it (:func:`project`)."""
    return jax.shard_map(lambda x, w: project(x[0], w)[None], mesh=mesh, in_specs=(P(AXIS_NAME), P(None, AXIS_NAME)),
                         out_specs=P(AXIS_NAME))(routed, kernel)


@functools.partial(jax.jit, static_argnums=2)
def _dot_block(routed, kernel, mesh):
    """Each rank's [T, L] x [L, H/p] as a plain ``jnp.dot`` of its T rows."""
    return jax.shard_map(lambda x, w: jnp.dot(x[0], w, preferred_element_type=jnp.float32)[None], mesh=mesh,
                         in_specs=(P(AXIS_NAME), P(None, AXIS_NAME)), out_specs=P(AXIS_NAME))(routed, kernel)


def print_table(rows: list[dict]) -> None:
    print(f"{'part':<7}{'tier / GEMM':<16}{'layout':<11}{'T':>5}{'median ms':>11}{'q25-q75 ms':>18}{'x T=2':>8}")
    for row in sorted(rows, key=lambda r: (r["part"] != "tiers", r["name"], r["weight_layout"], r["num_tokens"])):
        spread = f"{format_ms(row['q25_s'])}-{format_ms(row['q75_s'])}"
        print(f"{row['part']:<7}{row['name']:<16}{row['weight_layout']:<11}{row['num_tokens']:>5}"
              f"{format_ms(row['median_s']):>11}{spread:>18}{row['vs_two_rows']:>8.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
