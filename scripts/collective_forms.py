"""One all-reduce against reduce-scatter + all-gather, for a sum over the TP ranks of a [rows, width] buffer.

    python scripts/collective_forms.py [--devices 8] [--rows 16,64,256,1024,2048] [--widths 3584,7168,17920]
                                       [--dtypes bfloat16,float32] [--quantized int8,int6,int4] [--repeats 7]
                                       [--json FILE]

Decides, per backend, which form of the same sum is faster, and whether the dtype moved matters; with
--quantized, what the tail's quantised two-shot sum (vLLM ROCm QuickReduce) costs against them.

Mesh: a 1-d mesh "tp" of all GPUs when there are any; otherwise of --devices forced CPU devices
(default 8; the CPU platform is selected when JAX_PLATFORMS is unset and no GPU device node exists).

Buffers: every [rows, width] of --rows x --widths (default widths: Kimi-K3's latent L = 3584, hidden
H = 7168 and the one_shot tier's packed 2H + L = 17920) in each dtype of --dtypes. Each rank holds its
own random partial: a [p * rows, width] global array sharded P("tp") on dim 0, placed on the mesh
before timing, so no host transfer is timed.

Forms, each jax.jit(jax.shard_map(..., in_specs=P("tp"), out_specs=P())), every rank ending with the
whole [rows, width] sum:

  all-reduce  jax.lax.psum(x, "tp")
  RS+AG       jax.lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True), then
              jax.lax.all_gather(..., "tp", axis=0, tiled=True)
  and, for a dtype narrower than float32, both forms again with the buffer cast to float32 before the
  collective and back to its dtype after ("moved float32"; they move twice the bytes).
  With --quantized CODEC,...: for each codec (int8, int6, int4) the tail's own sum,
  ``k3_tail.ops.collectives.all_reduce`` with a Kimi-K3 TailConfig of the buffer's dtype,
  ``all_reduce_quantization=CODEC`` and ``quantized_all_reduce_min_bytes=0`` (so every buffer is
  quantised): block-encode, all-to-all, float32 sum of the own chunk, re-encode, all-gather, decode
  ("CODEC two-shot"; :mod:`k3_tail.ops.collectives`).

Timing: per buffer, each form is compiled and run --warmup times untimed, then --repeats rounds,
each round running every form once (round robin, the starting form rotating from round to round),
each run timed with time.perf_counter around the call and block_until_ready. Load drifts (other jobs
on the host) thus hit all forms of a buffer alike. Reported per form: median and quartiles (q25-q75,
numpy's linear interpolation) in ms; per pair: the ratio of medians RS+AG / all-reduce and the
quartiles of the per-round ratios (each RS+AG run over the all-reduce run of the same round).

Numerics: after the warm-up, each form's result is compared with the all-reduce of the same moved
dtype (a quantised form: with the all-reduce moving the buffer as is) and with a float64 sum of the
partials on the host: max |a - b| / max |b| over the buffer.

Compiled program: the number of all-reduce, reduce-scatter, all-gather and all-to-all ops in each
form's compiled HLO is recorded (a backend could rewrite one form into the other); a mismatch is flagged.

Output: a table (one line per buffer and moved dtype), then one summary line per dtype and moved
dtype: the smallest buffer size (bytes of the buffer in its own dtype, per rank) from which RS+AG is
faster by more than --margin (ratio of medians < 1 - margin) in every measured case at or above that
size, or "never"; and the same rule with the per-round ratios' q75 (a stricter, noise-aware reading).
With --quantized, a second table: per buffer and codec, the quantised sum's median and quartiles
against the all-reduce moving the buffer as is (lax.psum), the ratio of medians quantised / all-reduce
and the quartiles of its per-round ratios, the ratio of medians to RS+AG, and the numerics. Absolute
times on a shared host drift; the ratios, taken within one run and round by round, are what to read.
--json FILE also writes the machine (jax version, backend, device kind and count, cpu count, load
averages at start and end and per buffer), the settings and every run time. Exit status 0, or 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3_tail.cli.common import (
    CommandError, choice_list, demo_devices, format_ms, positive_int, positive_int_list, progress, use_cpu_without_gpu,
)
from k3_tail.config import TailConfig
from k3_tail.ops.codecs import CODECS
from k3_tail.ops.collectives import all_reduce as tail_all_reduce
from k3_tail.tools.benchmark import machine_info

AXIS_NAME = "tp"
DEFAULT_ROWS = (16, 64, 256, 1024, 2048)
DEFAULT_WIDTHS = (3584, 7168, 17920)  # Kimi-K3: L, H, 2H + L
DEFAULT_DTYPES = ("bfloat16", "float32")
DTYPES = ("bfloat16", "float16", "float32")
ALL_REDUCE, SPLIT, QUANTIZED = "all-reduce", "RS+AG", "two-shot"
# Collective ops expected in each form's compiled HLO.
EXPECTED_OPS = {ALL_REDUCE: {"all-reduce": 1, "reduce-scatter": 0, "all-gather": 0, "all-to-all": 0},
                SPLIT: {"all-reduce": 0, "reduce-scatter": 1, "all-gather": 1, "all-to-all": 0},
                QUANTIZED: {"all-reduce": 0, "reduce-scatter": 0, "all-gather": 1, "all-to-all": 1}}
HLO_OP = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all)(?:-start)?\(")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time a sum over the TP ranks of a [rows, width] buffer as one all-reduce (psum) and as "
        "reduce-scatter + all-gather (psum_scatter, all_gather), in the buffer's dtype and, for bf16/f16, "
        "cast to float32 around the collective. See the module docstring for the method.",
    )
    parser.add_argument("--devices", type=positive_int, default=8, metavar="N",
                        help="CPU devices to make without a GPU (default: 8); with GPUs all GPUs are used")
    parser.add_argument("--rows", type=positive_int_list, default=DEFAULT_ROWS, metavar="R,R,...",
                        help="buffer rows per rank, each a multiple of the device count "
                        f"(default: {','.join(map(str, DEFAULT_ROWS))})")
    parser.add_argument("--widths", type=positive_int_list, default=DEFAULT_WIDTHS, metavar="W,W,...",
                        help=f"buffer widths (default: {','.join(map(str, DEFAULT_WIDTHS))}: Kimi-K3's L, H and 2H+L)")
    parser.add_argument("--dtypes", type=choice_list(tuple(DTYPES), "dtypes"), default=DEFAULT_DTYPES,
                        metavar="D,D,...",
                        help=f"buffer dtypes among {', '.join(DTYPES)} (default: {','.join(DEFAULT_DTYPES)}); "
                        "those narrower than float32 are also timed cast to float32 around the collective")
    parser.add_argument("--quantized", type=choice_list(tuple(CODECS), "codecs"), default=(), metavar="C,C,...",
                        help=f"also time the tail's quantised two-shot sum with each codec among {', '.join(CODECS)} "
                        "(k3_tail.ops.collectives.all_reduce, every buffer quantised; default: none)")
    parser.add_argument("--repeats", type=positive_int, default=7, metavar="N",
                        help="timed rounds per buffer, each running every form once (default: 7)")
    parser.add_argument("--warmup", type=positive_int, default=1, metavar="N",
                        help="untimed runs of each form before them, after compiling (default: 1)")
    parser.add_argument("--margin", type=float, default=0.10,
                        help="summary: RS+AG counts as faster when its ratio to all-reduce is below 1 - margin "
                        "(default: 0.10)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the partials (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the machine, the settings and every run time")
    args = parser.parse_args(argv)
    if not 0 <= args.margin < 1:
        parser.error(f"--margin: expected a value in [0, 1), got {args.margin}")
    return args


def make_forms(mesh: jax.sharding.Mesh, dtype: jnp.dtype, quantized: tuple[str, ...] = ()
               ) -> list[tuple[str, str, str, Any]]:
    """(key, form, moved dtype name, jitted function) for every form timed on a buffer of ``dtype``; a
    quantised form (one per codec of ``quantized``) has the codec's name as its moved dtype."""

    def all_reduce(x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, AXIS_NAME)

    def split(x: jax.Array) -> jax.Array:
        own = jax.lax.psum_scatter(x, AXIS_NAME, scatter_dimension=0, tiled=True)
        # to="invarying": the gathered sum is the same on every rank, as out_specs P() requires.
        return jax.lax.all_gather(own, AXIS_NAME, axis=0, tiled=True, to="invarying")

    def as_float32(collective):
        def body(x: jax.Array) -> jax.Array:
            return collective(x.astype(jnp.float32)).astype(x.dtype)
        return body

    moved = [(jnp.dtype(dtype).name, lambda c: c)]
    if jnp.dtype(dtype).itemsize < 4:
        moved.append(("float32", as_float32))
    forms = []
    for moved_name, wrap in moved:
        for form, collective in ((ALL_REDUCE, all_reduce), (SPLIT, split)):
            function = jax.jit(jax.shard_map(wrap(collective), mesh=mesh, in_specs=P(AXIS_NAME), out_specs=P()))
            forms.append((f"{form} moved {moved_name}", form, moved_name, function))
    for codec in quantized:
        config = TailConfig.kimi_k3(dtype=dtype, all_reduce_quantization=codec, quantized_all_reduce_min_bytes=0)

        def quantized_sum(x: jax.Array, config: TailConfig = config) -> jax.Array:
            return tail_all_reduce(x, axis_name=AXIS_NAME, config=config, platform=None)

        function = jax.jit(jax.shard_map(quantized_sum, mesh=mesh, in_specs=P(AXIS_NAME), out_specs=P()))
        forms.append((quantized_key(codec), QUANTIZED, codec, function))
    return forms


def quantized_key(codec: str) -> str:
    """The key of the quantised form with ``codec`` ("int8 two-shot")."""
    return f"{codec} {QUANTIZED}"


def stats(values: list[float]) -> dict[str, float]:
    q25, median, q75 = np.percentile(np.asarray(values, dtype=np.float64), [25, 50, 75])
    return {"median": float(median), "q25": float(q25), "q75": float(q75)}


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (normwise, so entries of b near zero do not blow it up)."""
    scale = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b))) / scale if scale else float(np.max(np.abs(a - b)))


def measure_buffer(mesh, rows: int, width: int, dtype_name: str, args, key) -> dict[str, Any]:
    """Every form on one [rows, width] buffer of ``dtype_name``: run times, HLO op counts, numerics."""
    tp_size = mesh.devices.size
    dtype = jnp.dtype(dtype_name)
    sharding = NamedSharding(mesh, P(AXIS_NAME))
    x = jax.jit(lambda k: jax.random.normal(k, (tp_size * rows, width), dtype), out_shardings=sharding)(key)
    x.block_until_ready()
    forms = make_forms(mesh, dtype, args.quantized)
    compiled, hlo_ops, results = {}, {}, {}
    for name, form, _, function in forms:
        executable = function.lower(x).compile()
        text = executable.as_text()
        counts = {op: 0 for op in EXPECTED_OPS[form]}
        for match in HLO_OP.finditer(text):
            counts[match.group(1)] += 1
        hlo_ops[name] = counts
        compiled[name] = executable
        for _ in range(args.warmup):
            out = executable(x)
            out.block_until_ready()
        results[name] = np.asarray(out.addressable_shards[0].data, dtype=np.float64)
        del out
    reference = np.zeros((rows, width), np.float64)
    for shard in x.addressable_shards:
        reference += np.asarray(shard.data, dtype=np.float64)
    numerics = {}
    for name, form, moved, _ in forms:
        entry = {"vs_float64_sum": relative_difference(results[name], reference)}
        if form == SPLIT:
            entry["vs_all_reduce"] = relative_difference(results[name], results[f"{ALL_REDUCE} moved {moved}"])
        elif form == QUANTIZED:
            entry["vs_all_reduce"] = relative_difference(results[name], results[f"{ALL_REDUCE} moved {dtype_name}"])
        numerics[name] = entry
    del results, reference

    names = [name for name, *_ in forms]
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.repeats):
        start = round_index % len(names)
        for name in names[start:] + names[:start]:
            began = time.perf_counter()
            compiled[name](x).block_until_ready()
            times[name].append(time.perf_counter() - began)
    del x, compiled
    gc.collect()

    pairs = []
    for moved in dict.fromkeys(moved for _, form, moved, _ in forms if form != QUANTIZED):
        reduce_times, split_times = times[f"{ALL_REDUCE} moved {moved}"], times[f"{SPLIT} moved {moved}"]
        per_round = [s / r for s, r in zip(split_times, reduce_times, strict=True)]
        pair = {
            "moved_dtype": moved,
            "all_reduce_s": stats(reduce_times),
            "split_s": stats(split_times),
            "ratio_of_medians": float(np.median(split_times) / np.median(reduce_times)),
            "per_round_ratio": stats(per_round),
            "split_vs_all_reduce": numerics[f"{SPLIT} moved {moved}"]["vs_all_reduce"],
        }
        if moved != dtype_name:  # vs the same form moving the buffer as is
            pair["all_reduce_vs_as_is"] = float(
                np.median(reduce_times) / np.median(times[f"{ALL_REDUCE} moved {dtype_name}"]))
            pair["split_vs_as_is"] = float(np.median(split_times) / np.median(times[f"{SPLIT} moved {dtype_name}"]))
        pairs.append(pair)
    reduce_times, split_times = times[f"{ALL_REDUCE} moved {dtype_name}"], times[f"{SPLIT} moved {dtype_name}"]
    quantized = []
    for codec in args.quantized:
        quantized_times = times[quantized_key(codec)]
        quantized.append({
            "codec": codec,
            "quantized_s": stats(quantized_times),
            "all_reduce_s": stats(reduce_times),
            "ratio_of_medians": float(np.median(quantized_times) / np.median(reduce_times)),
            "per_round_ratio": stats([q / r for q, r in zip(quantized_times, reduce_times, strict=True)]),
            "vs_split_ratio_of_medians": float(np.median(quantized_times) / np.median(split_times)),
            **numerics[quantized_key(codec)],
        })
    return {
        "rows": rows, "width": width, "dtype": dtype_name, "bytes": rows * width * dtype.itemsize,
        "times_s": times, "hlo_ops": hlo_ops,
        "hlo_as_expected": all(hlo_ops[name] == EXPECTED_OPS[form] for name, form, _, _ in forms),
        "numerics": numerics, "pairs": pairs, "quantized": quantized,
    }


def spread(s: dict[str, float]) -> str:
    return f"{format_ms(s['median'])} ({format_ms(s['q25'])}-{format_ms(s['q75'])})"


def format_table(buffers: list[dict[str, Any]]) -> str:
    header = (f"{'rows':>5}{'width':>7}  {'dtype':<9}{'moved':<9}{'MiB':>7}  {'all-reduce ms (q25-q75)':>25}"
              f"{'RS+AG ms (q25-q75)':>25}{'RS+AG/AR':>10}{'per-round q25-q75':>19}{'sep':>5}"
              f"{'AR x as-is':>11}{'RS x as-is':>11}{'rel diff':>10}")
    lines = [header]
    ordered = sorted(buffers, key=lambda b: (b["dtype"], b["width"], b["rows"]))
    previous = None
    for buffer in ordered:
        if previous is not None and (buffer["dtype"], buffer["width"]) != previous:
            lines.append("")
        previous = buffer["dtype"], buffer["width"]
        for pair in buffer["pairs"]:
            reduce_s, split_s, per_round = pair["all_reduce_s"], pair["split_s"], pair["per_round_ratio"]
            separated = "<" if split_s["q75"] < reduce_s["q25"] else ">" if split_s["q25"] > reduce_s["q75"] else "~"
            as_is = [f"{pair[k]:.2f}" if k in pair else "-" for k in ("all_reduce_vs_as_is", "split_vs_as_is")]
            flag = "" if buffer["hlo_as_expected"] else "  HLO!"
            lines.append(
                f"{buffer['rows']:>5}{buffer['width']:>7}  {buffer['dtype']:<9}{pair['moved_dtype']:<9}"
                f"{buffer['bytes'] / 2**20:>7.2f}  {spread(reduce_s):>25}{spread(split_s):>25}"
                f"{pair['ratio_of_medians']:>10.2f}{per_round['q25']:>10.2f}-{per_round['q75']:<8.2f}{separated:>5}"
                f"{as_is[0]:>11}{as_is[1]:>11}{pair['split_vs_all_reduce']:>10.1e}{flag}")
    lines += [
        "",
        "MiB: the buffer per rank in its own dtype (moved float32 moves twice that). RS+AG/AR: ratio of medians.",
        "per-round: quartiles of RS+AG/all-reduce within each round. sep: '<' RS+AG q75 below all-reduce q25,",
        "'>' the reverse, '~' the quartile ranges overlap. AR/RS x as-is: median of the form moving float32 over",
        "the same form moving the buffer as is. rel diff: max |RS+AG - all-reduce| / max |all-reduce| (same moved",
        "dtype). HLO!: a form's compiled HLO does not hold the expected collectives (see the JSON).",
    ]
    return "\n".join(lines)


def format_quantized_table(buffers: list[dict[str, Any]]) -> str:
    header = (f"{'rows':>5}{'width':>7}  {'dtype':<9}{'codec':<6}{'MiB':>7}  {'all-reduce ms (q25-q75)':>25}"
              f"{'two-shot ms (q25-q75)':>25}{'Q/AR':>7}{'per-round q25-q75':>19}{'sep':>5}{'Q/RS+AG':>9}"
              f"{'vs AR':>9}{'vs f64':>9}{'AR vs f64':>10}")
    lines = [header]
    previous = None
    for buffer in sorted(buffers, key=lambda b: (b["dtype"], b["width"], b["rows"])):
        if previous is not None and (buffer["dtype"], buffer["width"]) != previous:
            lines.append("")
        previous = buffer["dtype"], buffer["width"]
        reference = buffer["numerics"][f"{ALL_REDUCE} moved {buffer['dtype']}"]["vs_float64_sum"]
        for entry in buffer["quantized"]:
            reduce_s, quantized_s, per_round = entry["all_reduce_s"], entry["quantized_s"], entry["per_round_ratio"]
            separated = ("<" if quantized_s["q75"] < reduce_s["q25"] else ">" if quantized_s["q25"] > reduce_s["q75"]
                         else "~")
            flag = "" if buffer["hlo_as_expected"] else "  HLO!"
            lines.append(
                f"{buffer['rows']:>5}{buffer['width']:>7}  {buffer['dtype']:<9}{entry['codec']:<6}"
                f"{buffer['bytes'] / 2**20:>7.2f}  {spread(reduce_s):>25}{spread(quantized_s):>25}"
                f"{entry['ratio_of_medians']:>7.2f}{per_round['q25']:>10.2f}-{per_round['q75']:<8.2f}{separated:>5}"
                f"{entry['vs_split_ratio_of_medians']:>9.2f}{entry['vs_all_reduce']:>9.1e}"
                f"{entry['vs_float64_sum']:>9.1e}{reference:>10.1e}{flag}")
    lines += [
        "",
        "two-shot: k3_tail.ops.collectives.all_reduce with the codec, every buffer quantised. all-reduce: lax.psum",
        "of the buffer as is. Q/AR: ratio of medians; per-round: quartiles of two-shot/all-reduce within each round;",
        "sep as above. Q/RS+AG: ratio of medians to RS+AG moving the buffer as is. vs AR, vs f64: max |two-shot - b|",
        "/ max |b| with b the all-reduce's result and the float64 sum; AR vs f64: the all-reduce's own.",
    ]
    return "\n".join(lines)


def threshold(cases: list[tuple[int, float]], limit: float) -> int | None:
    """The smallest measured size from which every case (size, value) at or above it has value < limit."""
    sizes = sorted({size for size, _ in cases})
    best = None
    for size in reversed(sizes):
        if all(value < limit for s, value in cases if s >= size):
            best = size
        else:
            break
    return best


def describe_threshold(size: int | None, pairs: list[dict[str, Any]]) -> str:
    """``size`` in bytes and MiB with how many of ``pairs`` are at or above it, or "never"."""
    if size is None:
        return "never"
    count = sum(pair["bytes"] >= size for pair in pairs)
    return f"{size} bytes ({size / 2**20:.2f} MiB; {count} of {len(pairs)} cases at or above)"


def format_summary(buffers: list[dict[str, Any]], margin: float) -> tuple[list[str], dict[str, Any]]:
    limit = 1 - margin
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for buffer in buffers:
        for pair in buffer["pairs"]:
            groups.setdefault((buffer["dtype"], pair["moved_dtype"]), []).append(
                {"bytes": buffer["bytes"], **pair})
    lines, summary = [], {}
    for (dtype, moved), pairs in groups.items():
        by_median = threshold([(p["bytes"], p["ratio_of_medians"]) for p in pairs], limit)
        by_q75 = threshold([(p["bytes"], p["per_round_ratio"]["q75"]) for p in pairs], limit)
        label = dtype if moved == dtype else f"{dtype} moved {moved}"

        lines.append(f"{label}: smallest size from which RS+AG is faster by > {margin:.0%} (RS+AG/AR < {limit:.2f}) "
                     f"in every case: {describe_threshold(by_median, pairs)}; with the per-round ratio's q75 "
                     f"< {limit:.2f} as well: {describe_threshold(by_q75, pairs)}")
        summary[label] = {"from_bytes_ratio_of_medians": by_median, "from_bytes_per_round_q75": by_q75}
    return lines, summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_cpu_without_gpu()
    try:
        devices = demo_devices(args.devices)
    except CommandError as error:
        print(f"collective_forms.py: error: {error}", file=sys.stderr)
        return 2
    tp_size = len(devices)
    bad_rows = [rows for rows in args.rows if rows % tp_size]
    if bad_rows:
        print(f"collective_forms.py: error: --rows {','.join(map(str, bad_rows))}: not a multiple of the "
              f"{tp_size} devices (the reduce-scatter splits rows)", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((tp_size,), (AXIS_NAME,), devices=devices)
    started = time.perf_counter()
    load_start = os.getloadavg()
    machine = machine_info()
    print(f"machine: {machine['cpu_count']} x {machine['cpu_model']}; jax {machine['jax']}; {tp_size} "
          f"{devices[0].platform} devices ({devices[0].device_kind}); load average {load_start[0]:.2f} "
          f"{load_start[1]:.2f} {load_start[2]:.2f} at start")
    print(f"{args.warmup} warm-up + {args.repeats} timed rounds per buffer, forms round robin; seed {args.seed}")

    key = jax.random.key(args.seed)
    cases = [(rows, width, dtype) for rows in args.rows for width in args.widths for dtype in args.dtypes]
    buffers = []
    for index, (rows, width, dtype) in enumerate(cases):
        progress(f"[{index + 1}/{len(cases)}] {time.perf_counter() - started:.0f} s  [{rows}, {width}] {dtype}")
        load = os.getloadavg()[0]
        buffer = measure_buffer(mesh, rows, width, dtype, args, jax.random.fold_in(key, index))
        buffer["load_average_1min_before"] = load
        buffers.append(buffer)

    elapsed = time.perf_counter() - started
    load_end = os.getloadavg()
    print()
    print(format_table(buffers))
    if args.quantized:
        print()
        print(format_quantized_table(buffers))
    print()
    summary_lines, summary = format_summary(buffers, args.margin)
    for line in summary_lines:
        print(line)
    print()
    worst: dict[str, float] = {}
    for buffer in buffers:
        for name, entry in buffer["numerics"].items():
            label = f"{buffer['dtype']} {name}"
            worst[label] = max(worst.get(label, 0.0), entry["vs_float64_sum"])
    print("max over buffers of max |form - float64 sum| / max |float64 sum|, per buffer dtype and form:")
    for label, value in worst.items():
        print(f"  {label}: {value:.1e}")
    if not all(buffer["hlo_as_expected"] for buffer in buffers):
        print("warning: some compiled programs do not hold the expected collectives (HLO! rows; see hlo_ops)")
    print(f"elapsed {elapsed:.0f} s; load average {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f} at end")

    if args.json:
        machine.update(load_average_start=list(load_start), load_average_end=list(load_end),
                       mesh_devices=tp_size, mesh_platform=devices[0].platform)
        settings = {name: value for name, value in vars(args).items() if name != "json"}
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({"machine": machine, "settings": settings, "elapsed_s": elapsed, "summary": summary,
                       "buffers": buffers}, file, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
