"""The command line: ``k3-tail COMMAND`` (or ``python -m k3_tail COMMAND``).

Commands:
  demo  Run the Kimi-K3 tail (H=7168, L=3584, bf16) on a TP mesh for a few token counts, on every
        tier, and print a table: for each token count T the tier :func:`k3_tail.select_tier` picks
        and why, and for each tier its error against the native tier and its median run time.
  hlo   Compile one tail call (Kimi-K3 shapes) for a deviceless GPU topology (``h100x8``, ...), a
        CPU mesh or this machine's accelerators, and print :mod:`k3_tail.xla_report`'s report:
        per-device cost, every collective, and whether the shared reduction overlaps the GEMM.

The demo builds its own mesh: with an accelerator backend (GPU) it uses all of that backend's
devices; otherwise it asks JAX for ``--devices`` CPU devices (8 by default), which must happen
before JAX initialises its backend, so the demo does it first. Inputs are random with a fixed
seed and are placed on the mesh once, the weights before the first token count and each T's
partials before its runs, so the times measure the tail, not host transfers. Each (T, tier) runs
once to compile (the warm-up), then ``--repeats`` timed runs. The exit status is 1 when some tier
is further than ``RELATIVE_ERROR_TOLERANCE`` from native (relative Frobenius error), 0 otherwise.

Each command is a subparser whose ``run`` default takes the parsed arguments and returns the exit
status; a :class:`CommandError` is reported in one line with exit status 2.

On a machine without a GPU, with a GPU plugin installed (the ``[aot]`` extra), JAX would print the
plugin's failed start-up (a cuDNN traceback) before falling back to the CPU. ``main`` therefore
selects the CPU platform itself when neither ``JAX_PLATFORMS`` is set nor a GPU device node
(``/dev/nvidiactl`` for CUDA, ``/dev/kfd`` for ROCm) exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail import xla_report
from k3_tail.columns import WEIGHT_LAYOUTS, padded_hidden_size
from k3_tail.compilation import compile_tail, compiler_options
from k3_tail.config import TailConfig
from k3_tail.forward import tail_forward
from k3_tail.selection import Tier, TierDecision, select_tier
from k3_tail.topologies import TopologyUnavailable, topology_mesh

PROG = "k3-tail"
AXIS_NAME = "tp"

DEFAULT_TOKEN_COUNTS = (1, 16, 64, 320)
DEFAULT_REPEATS = 5
DEFAULT_CPU_DEVICES = 8
DEFAULT_SEED = 0
# bf16 keeps 8 significand bits: tiers that sum and round in another order differ by a few 1e-3.
RELATIVE_ERROR_TOLERANCE = 1e-2
DEFAULT_HLO_TOKENS = 16
DEFAULT_TOPOLOGY = "h100x8"
# Device nodes whose presence means a GPU backend can start (CUDA, ROCm).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


class CommandError(Exception):
    """A failure to report to the user in one line (no traceback); ``main`` returns 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the chosen command, return its exit status."""
    args = build_parser().parse_args(argv)
    use_cpu_without_gpu()
    try:
        return args.run(args)
    except CommandError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subparser per command."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="The Kimi-K3 latent MoE tail under tensor parallelism, in JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_command(commands)
    add_hlo_command(commands)
    return parser


def use_cpu_without_gpu() -> None:
    """Select JAX's CPU platform when the user chose none and no GPU device node exists.

    Keeps a GPU plugin that cannot start from printing its traceback (module docstring). Does
    nothing once JAX's backends are up, or when ``JAX_PLATFORMS`` / ``jax_platforms`` is set.
    """
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass  # the backend is already initialised: nothing left to protect


def add_demo_command(commands: argparse._SubParsersAction) -> None:
    """Register ``demo``: every tier on Kimi-K3 shapes, checked against native and timed."""
    demo = commands.add_parser(
        "demo",
        help="run every tier on Kimi-K3 shapes, check it against native, time it",
        description="Run the Kimi-K3 tail (H=7168, L=3584, bf16) on every tier for a few token counts; "
        "print the tier select_tier picks and why, each tier's error against native and its median time.",
    )
    demo.add_argument(
        "--tokens", type=token_counts, default=DEFAULT_TOKEN_COUNTS, metavar="T,T,...",
        help=f"token counts to run, comma-separated (default: {','.join(map(str, DEFAULT_TOKEN_COUNTS))})",
    )
    demo.add_argument(
        "--repeats", type=positive_int, default=DEFAULT_REPEATS, metavar="N",
        help=f"timed runs per (T, tier) after the warm-up run (default: {DEFAULT_REPEATS})",
    )
    demo.add_argument(
        "--devices", type=positive_int, default=DEFAULT_CPU_DEVICES, metavar="N",
        help=f"CPU devices to make, the TP size without an accelerator (default: {DEFAULT_CPU_DEVICES}); "
        "with a GPU all GPUs are used",
    )
    demo.add_argument(
        "--weight-layout", choices=WEIGHT_LAYOUTS, default="column",
        help="where the up-projection kernel lives: column-sharded or replicated (default: column)",
    )
    demo.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default: {DEFAULT_SEED})")
    demo.set_defaults(run=run_demo)


def add_hlo_command(commands: argparse._SubParsersAction) -> None:
    """Register ``hlo``: the XLA report of one compiled tail call."""
    hlo = commands.add_parser(
        "hlo",
        help="compile one tail call and report its cost, collectives and overlap",
        description="Compile one Kimi-K3 tail call for a deviceless GPU topology (no GPU needed), a CPU mesh or "
        "this machine's accelerators, and print per-device FLOPs and bytes, every collective (kind, shape, bytes, "
        "async or not, what is scheduled inside it) and whether the shared reduction overlaps the GEMM.",
    )
    hlo.add_argument(
        "--tier", choices=["auto", *(tier.value for tier in Tier)], default="auto",
        help="tier to compile; auto: what select_tier picks for --tokens (default: auto)",
    )
    hlo.add_argument(
        "--tokens", type=non_negative_int, default=DEFAULT_HLO_TOKENS, metavar="T",
        help=f"token count T (default: {DEFAULT_HLO_TOKENS})",
    )
    hlo.add_argument(
        "--topology", default=DEFAULT_TOPOLOGY, metavar="NAME",
        help=f"h100x8, h200x8, mi300xx8, mi355xx8 (<target>x<count>, deviceless), cpu (--devices CPU devices) or "
        f"local (this machine's accelerators) (default: {DEFAULT_TOPOLOGY})",
    )
    hlo.add_argument(
        "--devices", type=positive_int, default=DEFAULT_CPU_DEVICES, metavar="N",
        help=f"CPU devices for --topology cpu (default: {DEFAULT_CPU_DEVICES})",
    )
    hlo.add_argument(
        "--weight-layout", choices=WEIGHT_LAYOUTS, default="column",
        help="where the up-projection kernel lives: column-sharded or replicated (default: column)",
    )
    hlo.add_argument("--json", action="store_true", help="print the report as JSON")
    hlo.set_defaults(run=run_hlo)


def run_hlo(args: argparse.Namespace) -> int:
    """The ``hlo`` command: compile, report, print (text or JSON)."""
    mesh = hlo_mesh(args.topology, args.devices)
    config = TailConfig.kimi_k3()
    tp_size = mesh.shape[AXIS_NAME]
    selection = select_tier(config, args.tokens, tp_size)
    tier = selection.tier if args.tier == "auto" else Tier.parse(args.tier)
    why = f"selected: {selection.reason}" if args.tier == "auto" else "forced by --tier"
    options = compiler_options(tier, mesh.devices.flat[0].platform)
    try:
        compiled = compile_tail(
            config, mesh, args.tokens, tier=tier, axis_name=AXIS_NAME, weight_layout=args.weight_layout
        )
    except ValueError as error:  # e.g. the one_shot tier with the column layout
        raise CommandError(str(error)) from None
    report = xla_report.report(compiled)
    if args.json:
        print(json.dumps({
            "topology": args.topology, "tier": tier.value, "tier_reason": why, "num_tokens": args.tokens,
            "tp_size": tp_size, "weight_layout": args.weight_layout, "compiler_options": options,
            "report": report.to_dict(),
        }, indent=2))
        return 0
    print(f"tier: {tier.value} ({why}); T={args.tokens}, p={tp_size}, kernel layout {args.weight_layout}")
    print(f"config: Kimi-K3 tail, H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}")
    print(f"topology: {args.topology}; compiler options: {options or 'none'}")
    print(report.format())
    return 0


def hlo_mesh(topology: str, cpu_device_count: int) -> Mesh:
    """The 1-d TP mesh to compile on: a deviceless topology, CPU devices or the local accelerators."""
    if topology == "cpu":
        devices = demo_devices(cpu_device_count, accelerators=False)
    elif topology == "local":
        devices = jax.devices()
    else:
        try:
            return topology_mesh(topology, axis_name=AXIS_NAME)
        except (ValueError, TopologyUnavailable) as error:
            raise CommandError(f"--topology: {error}") from None
    return jax.make_mesh((len(devices),), (AXIS_NAME,), devices=devices)


def positive_int(text: str) -> int:
    """``text`` as an integer >= 1 (argparse type)."""
    return bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    """``text`` as an integer >= 0 (argparse type)."""
    return bounded_int(text, 0)


def bounded_int(text: str, minimum: int) -> int:
    """``text`` as an integer >= ``minimum``, else argparse.ArgumentTypeError."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def token_counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of token counts, each >= 1 (argparse type)."""
    return tuple(positive_int(item.strip()) for item in text.split(","))


def run_demo(args: argparse.Namespace) -> int:
    """The ``demo`` command: see the module docstring. Returns 1 when a tier disagrees with native."""
    devices = demo_devices(args.devices)
    mesh = jax.make_mesh((len(devices),), (AXIS_NAME,), devices=devices)
    tp_size = mesh.shape[AXIS_NAME]
    config = TailConfig.kimi_k3()
    rng = np.random.default_rng(args.seed)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices")
    print(f"mesh: {AXIS_NAME}={tp_size} over {len(devices)} {devices[0].platform} devices")
    print(
        f"config: Kimi-K3 tail, H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}, "
        f"overlap_token_threshold={config.overlap_token_threshold}; kernel layout {args.weight_layout}"
    )
    print(
        f"runs: 1 warm-up + {args.repeats} timed per (T, tier), T in {', '.join(map(str, args.tokens))}; "
        f"seed {args.seed}"
    )
    print(flush=True)

    tiers = [tier for tier in Tier if tier.supports(args.weight_layout)]
    skipped = [tier.value for tier in Tier if tier not in tiers]
    if skipped:
        print(f"not run with kernel layout {args.weight_layout}: {', '.join(skipped)} "
              "(needs --weight-layout replicated)")
    progress("placing the weights on the mesh")
    norm_weight, up_proj_kernel = place_weights(config, mesh, args.weight_layout, rng)
    rows = []
    for index, num_tokens in enumerate(args.tokens, start=1):
        routed_partials, shared_partials = place_partials(config, mesh, num_tokens, rng)
        forward = functools.partial(
            tail_forward, routed_partials, shared_partials, norm_weight, up_proj_kernel,
            config=config, mesh=mesh, axis_name=AXIS_NAME, weight_layout=args.weight_layout,
        )
        selection = select_tier(config, num_tokens, tp_size)
        label = f"T={num_tokens} ({index}/{len(args.tokens)})"
        rows += run_every_tier(forward, tiers, num_tokens, selection, args.repeats, label)

    print_table(rows)
    # `not <=` so that a NaN error fails too.
    failures = [row for row in rows if not row.relative_error <= RELATIVE_ERROR_TOLERANCE]
    print()
    if not failures:
        print(f"every tier agrees with native: relative error <= {RELATIVE_ERROR_TOLERANCE:g} for every T")
        return 0
    for row in failures:
        print(
            f"FAIL: T={row.num_tokens} {row.tier.value}: relative error {row.relative_error:.3e} "
            f"vs native exceeds {RELATIVE_ERROR_TOLERANCE:g}"
        )
    return 1


def demo_devices(cpu_device_count: int, *, accelerators: bool = True) -> list[jax.Device]:
    """The devices to build the TP mesh on: all accelerators (when ``accelerators`` and the default
    backend is one), else ``cpu_device_count`` CPU devices.

    Sets JAX's CPU device count before anything initialises the backend. When the backend is
    already up (``main`` called inside a program that has used JAX) the count can no longer change;
    its CPU devices are used if there are enough, otherwise CommandError.
    """
    try:
        jax.config.update("jax_num_cpu_devices", cpu_device_count)
    except RuntimeError:
        pass  # the backend is already initialised: checked against the count below
    if accelerators and jax.default_backend() != "cpu":
        return jax.devices()
    cpu_devices = jax.devices("cpu")
    if len(cpu_devices) < cpu_device_count:
        raise CommandError(
            f"--devices {cpu_device_count}: JAX's CPU backend was already initialised with {len(cpu_devices)} "
            "device(s); run the demo in a fresh process"
        )
    return cpu_devices[:cpu_device_count]


def place_weights(
    config: TailConfig, mesh: Mesh, weight_layout: str, rng: np.random.Generator
) -> tuple[jax.Array, jax.Array]:
    """Random norm weight [L] (1 + 0.1 randn, replicated) and up-projection kernel (randn / sqrt(L)).

    The kernel is [L, H] replicated, or for the "column" layout column-sharded ``P(None, "tp")``,
    stored with zero columns up to ``padded_hidden_size(H, p)`` when p does not divide H.
    """
    latent, hidden = config.latent_size, config.hidden_size
    norm_weight = 1 + 0.1 * rng.standard_normal(latent, dtype=np.float32)
    kernel = rng.standard_normal((latent, hidden), dtype=np.float32) / np.sqrt(latent)
    if weight_layout == "column":
        padding = padded_hidden_size(hidden, mesh.shape[AXIS_NAME]) - hidden
        kernel, kernel_spec = np.pad(kernel, [(0, 0), (0, padding)]), P(None, AXIS_NAME)
    else:
        kernel_spec = P()
    return place(norm_weight, config, mesh, P()), place(kernel, config, mesh, kernel_spec)


def place_partials(
    config: TailConfig, mesh: Mesh, num_tokens: int, rng: np.random.Generator
) -> tuple[jax.Array, jax.Array]:
    """Random routed [p, T, L] and shared [p, T, H] partials (randn / sqrt(p)), rank i holding entry i."""
    tp_size = mesh.shape[AXIS_NAME]
    scale = 1 / np.sqrt(tp_size)
    routed = scale * rng.standard_normal((tp_size, num_tokens, config.latent_size), dtype=np.float32)
    shared = scale * rng.standard_normal((tp_size, num_tokens, config.hidden_size), dtype=np.float32)
    return place(routed, config, mesh, P(AXIS_NAME)), place(shared, config, mesh, P(AXIS_NAME))


def place(host_array: np.ndarray, config: TailConfig, mesh: Mesh, spec: P) -> jax.Array:
    """``host_array`` cast to ``config.dtype`` and put on ``mesh`` with sharding ``spec``."""
    return jax.device_put(jnp.asarray(host_array, dtype=config.dtype), NamedSharding(mesh, spec))


def time_runs(forward: Callable[[], jax.Array], repeats: int) -> tuple[jax.Array, float, float]:
    """Run ``forward`` once (compiling it), then ``repeats`` times more.

    Returns the warm-up run's output, its wall time in seconds and the median wall time of the
    timed runs in seconds; every run waits for its result to be ready.
    """
    start = time.perf_counter()
    output = forward().block_until_ready()
    warmup_seconds = time.perf_counter() - start
    run_seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward().block_until_ready()
        run_seconds.append(time.perf_counter() - start)
    return output, warmup_seconds, statistics.median(run_seconds)


@dataclasses.dataclass(frozen=True)
class TierRow:
    """One row of the demo's table: one tier at one token count, compared with the native tier."""

    num_tokens: int
    tier: Tier
    selection: TierDecision
    max_abs_error: float
    relative_error: float
    median_seconds: float


def run_every_tier(
    forward: Callable[..., jax.Array], tiers: Sequence[Tier], num_tokens: int, selection: TierDecision, repeats: int,
    label: str,
) -> list[TierRow]:
    """Time ``forward(tier=...)`` on each of ``tiers`` (native first) at one token count and compare
    each with native.

    ``selection`` is what :func:`select_tier` picks for this token count; ``label`` starts the
    progress lines.
    """
    timings = {}
    for tier in tiers:
        progress(f"{label} {tier.value}: ", end="")
        output, warmup_seconds, median_seconds = time_runs(functools.partial(forward, tier=tier), repeats)
        timings[tier] = np.asarray(output, dtype=np.float32), median_seconds
        progress(f"warm-up {warmup_seconds:.2f} s, median {1e3 * median_seconds:.1f} ms")
    native_output, _ = timings[Tier.NATIVE]
    native_norm = np.linalg.norm(native_output)
    rows = []
    for tier, (output, median_seconds) in timings.items():
        difference = output - native_output
        rows.append(TierRow(
            num_tokens, tier, selection,
            max_abs_error=float(np.max(np.abs(difference))),
            relative_error=float(np.linalg.norm(difference) / native_norm),
            median_seconds=median_seconds,
        ))
    return rows


def print_table(rows: Sequence[TierRow]) -> None:
    """The demo's table, one block of rows per token count; the selected tier's row gives the reason."""
    print(f"{'T':>5}  {'tier':<16}{'max abs err':>12}{'rel err':>11}{'median ms':>11}  selected because")
    previous_tokens = None
    for row in rows:
        if previous_tokens is not None and row.num_tokens != previous_tokens:
            print()
        previous_tokens = row.num_tokens
        if row.tier == Tier.NATIVE:
            errors = f"{'reference':>12}{'':>11}"
        else:
            errors = f"{row.max_abs_error:>12.3e}{row.relative_error:>11.3e}"
        reason = f"  <- {row.selection.reason}" if row.selection.tier == row.tier else ""
        print(f"{row.num_tokens:>5}  {row.tier.value:<16}{errors}{1e3 * row.median_seconds:>11.1f}{reason}")


def progress(message: str, end: str = "\n") -> None:
    """``message`` to stderr at once, so a long run shows what it is doing."""
    print(message, end=end, file=sys.stderr, flush=True)
