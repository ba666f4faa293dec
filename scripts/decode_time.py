"""Every tier and the bare rank-local GEMM at decode token counts, in one interleaved run on this machine's mesh.

    python scripts/decode_time.py [--tokens 1,2,16] [--devices 8] [--rounds 7] [--json FILE]

Method and results: docs/measurements/2026-12-01-decode-one-row-gemms.md.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from k3_tail import TailConfig, Tier, tail_forward
from k3_tail.cli.harness import AXIS_NAME, Experiment, positive_int_list, progress
from k3_tail.cli.tables import format_table, median_columns
from k3_tail.tools.benchmark import Timing, place_partials, place_weights, time_round_robin
from lab.blocks import WEIGHT_LAYOUTS, project


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__, repeats=7)
    experiment.parser.add_argument("--tokens", type=positive_int_list, default=(1, 2, 16), metavar="T,T,...",
                                   help="token counts, 2 among them (default: 1,2,16)")
    args = experiment.parse(argv)
    if 2 not in args.tokens:
        experiment.parser.error("--tokens: expected 2 among the token counts (the ratios are taken against T = 2)")
    mesh = experiment.mesh()
    rng = np.random.default_rng(args.seed)
    kimi = TailConfig.kimi_k3()
    weights = {layout: place_weights(kimi, mesh, layout, rng) for layout in WEIGHT_LAYOUTS}
    calls = {}
    for num_tokens in args.tokens:
        routed, shared = place_partials(kimi, mesh, num_tokens, rng)
        for tier in Tier:
            for layout in (layout for layout in WEIGHT_LAYOUTS if tier.supports(layout)):
                calls["tiers", tier.value, layout, num_tokens] = functools.partial(
                    tail_forward, routed, shared, *weights[layout], config=kimi, mesh=mesh, tier=tier,
                    weight_layout=layout)
        for form, gemm in (("project", project), ("jnp.dot", plain_dot)):
            calls["gemm", form, "column", num_tokens] = functools.partial(
                rank_gemm, routed, weights["column"][1], mesh=mesh, gemm=gemm)
    seconds = time_round_robin(calls, rounds=args.repeats, on_progress=progress)
    rows = [{"part": part, "name": name, "weight_layout": layout, "num_tokens": num_tokens,
             "timing": Timing.of(runs), "seconds": runs,
             "vs_two_rows": Timing.of(runs).median_s / Timing.of(seconds[part, name, layout, 2]).median_s}
            for (part, name, layout, num_tokens), runs in seconds.items()]
    rows.sort(key=lambda r: (r["part"] != "tiers", r["name"], r["weight_layout"], r["num_tokens"]))
    experiment.print(format_table(rows, [
        ("part", "<7", lambda r: r["part"]), ("tier / GEMM", "<16", lambda r: r["name"]),
        ("layout", "<11", lambda r: r["weight_layout"]), ("T", ">5", lambda r: r["num_tokens"]),
        *median_columns(lambda r: r["timing"]), ("x T=2", ">8.2f", lambda r: r["vs_two_rows"]),
    ]))
    return experiment.finish(rows=rows)


def plain_dot(latent: jax.Array, kernel: jax.Array) -> jax.Array:
    """[T, L] x [L, N] as a plain ``jnp.dot`` of its T rows, float32."""
    return jnp.dot(latent, kernel, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("mesh", "gemm"))
def rank_gemm(routed, kernel, *, mesh, gemm):
    """Each rank's [T, L] x [L, H/p] by ``gemm``, every rank at once."""
    return jax.shard_map(lambda x, w: gemm(x[0], w)[None], mesh=mesh, in_specs=(P(AXIS_NAME), P(None, AXIS_NAME)),
                         out_specs=P(AXIS_NAME))(routed, kernel)


if __name__ == "__main__":
    raise SystemExit(main())
