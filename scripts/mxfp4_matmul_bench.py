"""The prefill GEMM over MXFP4 experts: the Pallas kernel that decodes in its operand load against XLA's decode then
GEMM, timed in one interleaved run on the device it runs on.

    python scripts/mxfp4_matmul_bench.py [--experts 56] [--rows 46] [--shapes 3584x384,384x3584] [--rounds 20]
        [--interpret] [--json FILE]

Each shape K x N is one kernel of the capacity method's group (56 experts of Kimi-K3 at p = 8, 46 rows each at
T = 2048): 3584 x 384 the gate and up kernels, 384 x 3584 the down one. Both results are checked against each
other within float32 accumulation first. On a GPU it times the compiled kernel; with ``--interpret`` (a CPU) the
kernel runs in Pallas's interpret mode, which checks the script, not the speed. Method and results:
docs/measurements/2026-12-01-mxfp4-experts.md.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3_tail.cli.harness import Experiment, positive_int, use_cpu_without_gpu
from k3_tail.cli.tables import format_table, spread_ms
from k3_tail.models.kimi_k3.mxfp4 import decode
from k3_tail.models.kimi_k3.mxfp4_matmul import mxfp4_matmul, mxfp4_matmul_reference
from k3_tail.tools.benchmark import Timing, time_round_robin


def shape_list(text: str) -> tuple[tuple[int, int], ...]:
    """"KxN,KxN" -> ((K, N), ...)."""
    return tuple(tuple(int(size) for size in shape.split("x")) for shape in text.split(","))


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__, devices=False, repeats=20, warmup=2)
    add = experiment.parser.add_argument
    add("--experts", type=positive_int, default=56, help="kernels in the batch, S (default: 56)")
    add("--rows", type=positive_int, default=46, help="rows per kernel, C (default: 46)")
    add("--shapes", type=shape_list, default=((3584, 384), (384, 3584)), metavar="KxN,...",
        help="kernel shapes, K a multiple of 32 (default: 3584x384,384x3584)")
    add("--interpret", action="store_true", help="run the kernel in Pallas's interpret mode (a CPU)")
    args = experiment.parse(argv)
    use_cpu_without_gpu()
    device = jax.devices()[0]
    experiment.print(f"device: {device.device_kind}, jax {jax.__version__}")
    rng = np.random.default_rng(args.seed)
    kernel = jax.jit(functools.partial(mxfp4_matmul, interpret=args.interpret))
    reference = jax.jit(mxfp4_matmul_reference)
    rows = []
    for depth, columns in args.shapes:
        x = jax.device_put(jnp.asarray(rng.standard_normal((args.experts, args.rows, depth)), jnp.bfloat16), device)
        packed = jax.device_put(rng.integers(0, 256, (args.experts, depth // 2, columns), dtype=np.uint8), device)
        scale = jax.device_put(rng.integers(118, 123, (args.experts, depth // 32, columns), dtype=np.uint8), device)
        difference = float(jnp.max(jnp.abs(kernel(x, packed, scale) - reference(x, packed, scale))))
        # float32 accumulation's bound, 2 K 2^-24 (|x| @ |W|), at its largest.
        magnitudes = jnp.abs(x).astype(jnp.float32) @ jnp.abs(decode(packed, scale, jnp.float32))
        bound = 2 * depth * 2.0 ** -24 * float(jnp.max(magnitudes))
        if difference > bound:
            experiment.error(f"{depth}x{columns}: the kernel and XLA differ by {difference:g} > {bound:g}")
        calls = {"kernel": functools.partial(kernel, x, packed, scale),
                 "xla": functools.partial(reference, x, packed, scale)}
        seconds = time_round_robin(calls, rounds=args.repeats, warmup=args.warmup)
        timings = {key: Timing.of(values) for key, values in seconds.items()}
        rows.append({"shape": f"{depth}x{columns}", "kernel": timings["kernel"], "xla": timings["xla"],
                     "ratio": timings["kernel"].median_s / timings["xla"].median_s, "max_difference": difference})
    experiment.print(format_table(rows, [
        ("K x N", "<11", lambda row: row["shape"]),
        ("kernel ms (q25-q75)", ">22", lambda row: spread_ms(row["kernel"])),
        ("XLA decode + GEMM ms", ">22", lambda row: spread_ms(row["xla"])),
        ("kernel / XLA", ">13", lambda row: f"{row['ratio']:.2f}"),
    ], notes=[f"{args.experts} kernels of {args.rows} rows each, bf16 rows, {args.repeats} interleaved rounds"]))
    return experiment.finish(rows=rows)


if __name__ == "__main__":
    raise SystemExit(main())
