"""One all-reduce against reduce-scatter + all-gather (and the tail's quantised two-shot sum), per buffer.

    python scripts/collective_forms.py [--rows 16,64,256,1024,2048] [--widths 3584,7168,17920]
                                       [--dtypes bfloat16,float32] [--quantized int8,int6,int4] [--json FILE]

Method and results: docs/measurements/2026-11-30-collective-forms.md.
"""

import gc
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k3_tail import TailConfig
from k3_tail.cli.harness import AXIS_NAME, Experiment, choice_list, positive_int_list, progress
from k3_tail.cli.tables import format_table, spread_ms
from k3_tail.tools.benchmark import Timing, time_round_robin
from lab.blocks import CODEC_NAMES, all_reduce

DEFAULT_ROWS = (16, 64, 256, 1024, 2048)
DEFAULT_WIDTHS = (3584, 7168, 17920)  # Kimi-K3: L, H, 2H + L
DTYPES = ("bfloat16", "float16", "float32")
ALL_REDUCE, SPLIT, QUANTIZED = "all-reduce", "RS+AG", "two-shot"
OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
# Collective ops expected in each form's compiled HLO, in the order of OPS.
EXPECTED_OPS = {ALL_REDUCE: (1, 0, 0, 0), SPLIT: (0, 1, 1, 0), QUANTIZED: (0, 0, 1, 1)}
HLO_OP = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all)(?:-start)?\(")


def forms(mesh, dtype, quantized) -> list[tuple[str, str, str, object]]:
    """(key, form, moved dtype or codec, jitted function) of every form timed on a buffer of ``dtype``."""
    def split(x):
        own = jax.lax.psum_scatter(x, AXIS_NAME, scatter_dimension=0, tiled=True)
        # to="invarying": the gathered sum is the same on every rank, as out_specs P() requires.
        return jax.lax.all_gather(own, AXIS_NAME, axis=0, tiled=True, to="invarying")

    def as_float32(collective):
        return lambda x: collective(x.astype(jnp.float32)).astype(x.dtype)

    def compiled(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS_NAME), out_specs=P()))

    moved = [(dtype.name, lambda c: c)] + ([("float32", as_float32)] if dtype.itemsize < 4 else [])
    result = [(f"{form} moved {name}", form, name, compiled(wrap(body)))
              for name, wrap in moved
              for form, body in ((ALL_REDUCE, lambda x: jax.lax.psum(x, AXIS_NAME)), (SPLIT, split))]
    for codec in quantized:
        config = TailConfig.kimi_k3(dtype=dtype, all_reduce_quantization=codec, quantized_all_reduce_min_bytes=0)
        result.append((f"{codec} {QUANTIZED}", QUANTIZED, codec,
                       compiled(lambda x, config=config: all_reduce(x, config, axis_name=AXIS_NAME))))
    return result


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (normwise, so entries of b near zero do not blow it up)."""
    scale = float(np.max(np.abs(b)))
    difference = float(np.max(np.abs(a - b)))
    return difference / scale if scale else difference


def measure_buffer(mesh, rows: int, width: int, dtype_name: str, args, key) -> dict:
    """Every form on one [rows, width] buffer: run times, HLO op counts, numerics, pairs."""
    dtype = jnp.dtype(dtype_name)
    x = jax.jit(lambda k: jax.random.normal(k, (mesh.size * rows, width), dtype),
                out_shardings=NamedSharding(mesh, P(AXIS_NAME)))(key)
    timed = forms(mesh, dtype, args.quantized)
    executables, hlo_ops, results = {}, {}, {}
    for name, _, _, function in timed:
        executables[name] = function.lower(x).compile()
        found = [match.group(1) for match in HLO_OP.finditer(executables[name].as_text())]
        hlo_ops[name] = dict(zip(OPS, (found.count(op) for op in OPS), strict=True))
        for _ in range(args.warmup):
            out = executables[name](x).block_until_ready()
        results[name] = np.asarray(out.addressable_shards[0].data, dtype=np.float64)
    reference = sum(np.asarray(shard.data, dtype=np.float64) for shard in x.addressable_shards)
    as_is = f"{ALL_REDUCE} moved {dtype_name}"
    numerics = {name: {"vs_float64_sum": relative_difference(results[name], reference),
                       **({} if form == ALL_REDUCE else {"vs_all_reduce": relative_difference(
                           results[name], results[as_is if form == QUANTIZED else f"{ALL_REDUCE} moved {moved}"])})}
                for name, form, moved, _ in timed}
    del results, reference
    times = time_round_robin({name: lambda e=executable, x=x: e(x) for name, executable in executables.items()},
                             rounds=args.repeats)
    del x, executables
    gc.collect()

    def compare(name: str, against: str) -> dict:
        per_round = [a / b for a, b in zip(times[name], times[against], strict=True)]
        return {"ratio_of_medians": float(np.median(times[name]) / np.median(times[against])),
                "per_round_ratio": Timing.of(per_round)}

    pairs = []
    for moved in dict.fromkeys(moved for _, form, moved, _ in timed if form != QUANTIZED):
        reduce, split = f"{ALL_REDUCE} moved {moved}", f"{SPLIT} moved {moved}"
        pair = {"moved_dtype": moved, "all_reduce_s": Timing.of(times[reduce]), "split_s": Timing.of(times[split]),
                **compare(split, reduce), "split_vs_all_reduce": numerics[split]["vs_all_reduce"]}
        if moved != dtype_name:  # vs the same form moving the buffer as is
            pair["all_reduce_vs_as_is"] = compare(reduce, as_is)["ratio_of_medians"]
            pair["split_vs_as_is"] = compare(split, f"{SPLIT} moved {dtype_name}")["ratio_of_medians"]
        pairs.append(pair)
    quantized = [{"codec": codec, "quantized_s": Timing.of(times[f"{codec} {QUANTIZED}"]),
                  "all_reduce_s": Timing.of(times[as_is]), **compare(f"{codec} {QUANTIZED}", as_is),
                  "vs_split_ratio_of_medians": compare(f"{codec} {QUANTIZED}", f"{SPLIT} moved {dtype_name}")[
                      "ratio_of_medians"], **numerics[f"{codec} {QUANTIZED}"]} for codec in args.quantized]
    return {"rows": rows, "width": width, "dtype": dtype_name, "bytes": rows * width * dtype.itemsize,
            "times_s": times, "hlo_ops": hlo_ops,
            "hlo_as_expected": all(tuple(hlo_ops[name].values()) == EXPECTED_OPS[form] for name, form, _, _ in timed),
            "numerics": numerics, "pairs": pairs, "quantized": quantized}


def separated(faster: Timing, slower: Timing) -> str:
    """'<' when ``faster``'s q75 is below ``slower``'s q25, '>' the reverse, '~' when the ranges overlap."""
    return "<" if faster.q75_s < slower.q25_s else ">" if faster.q25_s > slower.q75_s else "~"


def buffer_columns(what: str) -> list:
    """The columns every table starts with, for entries {"buffer": ..., what: ...}."""
    return [("rows", ">5", lambda e: e["buffer"]["rows"]), ("width", ">7", lambda e: e["buffer"]["width"]),
            ("", "2", lambda e: ""), ("dtype", "<9", lambda e: e["buffer"]["dtype"]),
            (what, "<9", lambda e: e[what]), ("MiB", ">7.2f", lambda e: e["buffer"]["bytes"] / 2**20),
            ("", "2", lambda e: "")]


def format_tables(buffers: list[dict]) -> str:
    ordered = sorted(buffers, key=lambda b: (b["dtype"], b["width"], b["rows"]))
    group = lambda e: (e["buffer"]["dtype"], e["buffer"]["width"])  # noqa: E731
    flag = lambda e: "" if e["buffer"]["hlo_as_expected"] else "  HLO!"  # noqa: E731
    rounds = lambda e: f"{e['per_round_ratio'].q25_s:>10.2f}-{e['per_round_ratio'].q75_s:<8.2f}"  # noqa: E731
    pairs = [{"buffer": b, **pair} for b in ordered for pair in b["pairs"]]
    table = format_table(pairs, [
        *buffer_columns("moved_dtype"), ("all-reduce ms (q25-q75)", ">25", lambda e: spread_ms(e["all_reduce_s"])),
        ("RS+AG ms (q25-q75)", ">25", lambda e: spread_ms(e["split_s"])),
        ("RS+AG/AR", ">10.2f", lambda e: e["ratio_of_medians"]), ("per-round q25-q75", ">19", rounds),
        ("sep", ">5", lambda e: separated(e["split_s"], e["all_reduce_s"])),
        ("AR x as-is", ">11", lambda e: f"{e['all_reduce_vs_as_is']:.2f}" if "all_reduce_vs_as_is" in e else "-"),
        ("RS x as-is", ">11", lambda e: f"{e['split_vs_as_is']:.2f}" if "split_vs_as_is" in e else "-"),
        ("rel diff", ">10.1e", lambda e: e["split_vs_all_reduce"]), ("", "", flag),
    ], group=group, notes=[
        "", "MiB: the buffer per rank in its own dtype (moved float32 moves twice that). RS+AG/AR: ratio of medians.",
        "per-round: quartiles of RS+AG/all-reduce within each round. sep: '<' RS+AG q75 below all-reduce q25,",
        "'>' the reverse, '~' the quartile ranges overlap. AR/RS x as-is: median of the form moving float32 over",
        "the same form moving the buffer as is. rel diff: max |RS+AG - all-reduce| / max |all-reduce| (same moved",
        "dtype). HLO!: a form's compiled HLO does not hold the expected collectives (see the JSON)."])
    quantized = [{"buffer": b, **entry} for b in ordered for entry in b["quantized"]]
    if not quantized:
        return table
    return table + "\n\n" + format_table(quantized, [
        *buffer_columns("codec"), ("all-reduce ms (q25-q75)", ">25", lambda e: spread_ms(e["all_reduce_s"])),
        ("two-shot ms (q25-q75)", ">25", lambda e: spread_ms(e["quantized_s"])),
        ("Q/AR", ">7.2f", lambda e: e["ratio_of_medians"]), ("per-round q25-q75", ">19", rounds),
        ("sep", ">5", lambda e: separated(e["quantized_s"], e["all_reduce_s"])),
        ("Q/RS+AG", ">9.2f", lambda e: e["vs_split_ratio_of_medians"]),
        ("vs AR", ">9.1e", lambda e: e["vs_all_reduce"]), ("vs f64", ">9.1e", lambda e: e["vs_float64_sum"]),
        ("AR vs f64", ">10.1e",
         lambda e: e["buffer"]["numerics"][f"{ALL_REDUCE} moved {e['buffer']['dtype']}"]["vs_float64_sum"]),
        ("", "", flag),
    ], group=group, notes=[
        "", "two-shot: lab.blocks.all_reduce with the codec, every buffer quantised. all-reduce: lax.psum",
        "of the buffer as is. Q/AR: ratio of medians; per-round: quartiles of two-shot/all-reduce within each round;",
        "sep as above. Q/RS+AG: ratio of medians to RS+AG moving the buffer as is. vs AR, vs f64: max |two-shot - b|",
        "/ max |b| with b the all-reduce's result and the float64 sum; AR vs f64: the all-reduce's own."])


def threshold(cases: list[tuple[int, float]], limit: float) -> int | None:
    """The smallest measured size from which every case (size, value) at or above it has value < limit."""
    best = None
    for size in sorted({size for size, _ in cases}, reverse=True):
        if not all(value < limit for s, value in cases if s >= size):
            break
        best = size
    return best


def summary(buffers: list[dict], margin: float) -> tuple[list[str], dict]:
    limit, groups = 1 - margin, {}
    for buffer in buffers:
        for pair in buffer["pairs"]:
            groups.setdefault((buffer["dtype"], pair["moved_dtype"]), []).append({"bytes": buffer["bytes"], **pair})
    lines, result = [], {}

    def describe(size: int | None, pairs: list[dict]) -> str:
        if size is None:
            return "never"
        count = sum(pair["bytes"] >= size for pair in pairs)
        return f"{size} bytes ({size / 2**20:.2f} MiB; {count} of {len(pairs)} cases at or above)"

    for (dtype, moved), pairs in groups.items():
        by_median = threshold([(p["bytes"], p["ratio_of_medians"]) for p in pairs], limit)
        by_q75 = threshold([(p["bytes"], p["per_round_ratio"].q75_s) for p in pairs], limit)
        label = dtype if moved == dtype else f"{dtype} moved {moved}"
        lines.append(f"{label}: smallest size from which RS+AG is faster by > {margin:.0%} (RS+AG/AR < {limit:.2f}) "
                     f"in every case: {describe(by_median, pairs)}; with the per-round ratio's q75 "
                     f"< {limit:.2f} as well: {describe(by_q75, pairs)}")
        result[label] = {"from_bytes_ratio_of_medians": by_median, "from_bytes_per_round_q75": by_q75}
    return lines, result


def main(argv: list[str] | None = None) -> int:
    experiment = Experiment(__doc__, repeats=7, warmup=1)
    add = experiment.parser.add_argument
    add("--rows", type=positive_int_list, default=DEFAULT_ROWS, metavar="R,R,...",
        help=f"buffer rows per rank, each a multiple of the device count (default: {','.join(map(str, DEFAULT_ROWS))})")
    add("--widths", type=positive_int_list, default=DEFAULT_WIDTHS, metavar="W,W,...",
        help=f"buffer widths (default: {','.join(map(str, DEFAULT_WIDTHS))}: Kimi-K3's L, H and 2H+L)")
    add("--dtypes", type=choice_list(DTYPES, "dtypes"), default=("bfloat16", "float32"), metavar="D,D,...",
        help=f"buffer dtypes among {', '.join(DTYPES)} (default: bfloat16,float32); those narrower than float32 are "
        "also timed cast to float32 around the collective")
    add("--quantized", type=choice_list(CODEC_NAMES, "codecs"), default=(), metavar="C,C,...",
        help=f"also time the tail's quantised two-shot sum with each codec among {', '.join(CODEC_NAMES)} "
        "(default: none)")
    add("--margin", type=float, default=0.10,
        help="summary: RS+AG counts as faster when its ratio to all-reduce is below 1 - margin (default: 0.10)")
    args = experiment.parse(argv)
    if not 0 <= args.margin < 1:
        experiment.parser.error(f"--margin: expected a value in [0, 1), got {args.margin}")
    mesh = experiment.mesh()
    bad_rows = [rows for rows in args.rows if rows % mesh.size]
    if bad_rows:
        experiment.error(f"--rows {','.join(map(str, bad_rows))}: not a multiple of the {mesh.size} devices (the "
                         "reduce-scatter splits rows)")
    experiment.print(f"{args.warmup} warm-up + {args.repeats} timed rounds per buffer, forms round robin; "
                     f"seed {args.seed}")
    key = jax.random.key(args.seed)
    cases = [(rows, width, dtype) for rows in args.rows for width in args.widths for dtype in args.dtypes]
    buffers = []
    for index, (rows, width, dtype) in enumerate(cases):
        progress(f"[{index + 1}/{len(cases)}] [{rows}, {width}] {dtype}")
        load = os.getloadavg()[0]
        buffers.append({**measure_buffer(mesh, rows, width, dtype, args, jax.random.fold_in(key, index)),
                        "load_average_1min_before": load})
    lines, thresholds = summary(buffers, args.margin)
    worst: dict[str, float] = {}
    for buffer in buffers:
        for name, entry in buffer["numerics"].items():
            label = f"{buffer['dtype']} {name}"
            worst[label] = max(worst.get(label, 0.0), entry["vs_float64_sum"])
    experiment.print("", format_tables(buffers), "", *lines, "",
                     "max over buffers of max |form - float64 sum| / max |float64 sum|, per buffer dtype and form:",
                     *(f"  {label}: {value:.1e}" for label, value in worst.items()))
    if not all(buffer["hlo_as_expected"] for buffer in buffers):
        experiment.print("warning: some compiled programs do not hold the expected collectives (HLO! rows; see "
                         "hlo_ops)")
    return experiment.finish(summary=thresholds, buffers=buffers)


if __name__ == "__main__":
    raise SystemExit(main())
