"""What the commands share: errors, argument types, the devices, progress output and the measurement flags.

Devices: the commands that run the tail build their own 1-d TP mesh (axis ``AXIS_NAME``). With an
accelerator backend (GPU) they use all of that backend's devices; otherwise they ask JAX for
``--devices`` CPU devices (8 by default, at most ``MAX_CPU_DEVICES`` = 512: JAX builds every forced
CPU device before the first output, and 100000 of them take minutes and gigabytes in silence), which
must happen before JAX initialises its backend, so :func:`demo_devices` does it before anything else
touches JAX. ``--seed`` takes an integer in [0, 2**32), the range every numpy generator takes (numpy
refuses a negative seed with a traceback).

On a machine without a GPU, with a GPU plugin installed (the ``[aot]`` extra), JAX would print the
plugin's failed start-up (a cuDNN traceback) before falling back to the CPU. :func:`use_cpu_without_gpu`
(which ``main`` calls before running a command) therefore selects the CPU platform itself when
neither ``JAX_PLATFORMS`` is set nor a GPU device node (``/dev/nvidiactl`` for CUDA, ``/dev/kfd``
for ROCm) exists.

``bench`` and ``calibrate`` share their measurement flags (:func:`add_measurement_arguments`: what
to time, how often, and the tail config), their checks (:func:`measurement_config`,
:func:`measurement_tiers`) and their table (:func:`format_bench_table`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
import time
from collections.abc import Collection, Mapping, Sequence
from typing import IO

import jax
from jax.sharding import Mesh

from k3_tail.config import ALL_REDUCE_QUANTIZATIONS, TailConfig
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.rules import select_tier
from k3_tail.ops.collectives import ALL_REDUCE_FORMS
from k3_tail.ops.columns import WEIGHT_LAYOUTS
from k3_tail.tiers.registry import Tier
from k3_tail.ops.up_projection import FP8_FORMATS
from k3_tail.tools.benchmark import (
    CPU_MAX_TOKENS, DEFAULT_MAX_TOKENS, Measurement, Timing, check_tiers, machine_info, measure_tiers,
)

PROG = "k3-tail"
AXIS_NAME = "tp"

DEFAULT_REPEATS = 5
DEFAULT_CPU_DEVICES = 8
DEFAULT_SEED = 0
# The most CPU devices --devices forces (module docstring); seeds are integers below SEED_LIMIT.
MAX_CPU_DEVICES = 512
SEED_LIMIT = 2**32
CONFIG_DTYPES = ("bfloat16", "float16", "float32")
# The space between the columns of a plain-text table (format_table).
TABLE_GAP = "  "
# Device nodes whose presence means a GPU backend can start (CUDA, ROCm).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


class CommandError(Exception):
    """A failure to report to the user in one line (no traceback); ``main`` returns 2."""


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
            "device(s); run the command in a fresh process"
        )
    return cpu_devices[:cpu_device_count]


def tp_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """The 1-d TP mesh (axis ``AXIS_NAME``) over ``devices``."""
    return jax.make_mesh((len(devices),), (AXIS_NAME,), devices=devices)


def add_timing_arguments(parser: argparse.ArgumentParser, *, rounds: int) -> None:
    """A timing script's ``--devices``, ``--rounds`` (default ``rounds``), ``--seed`` and ``--json``."""
    parser.add_argument("--devices", type=cpu_device_count, default=8,
                        help=f"CPU devices without a GPU, at most {MAX_CPU_DEVICES} (default: 8)")
    parser.add_argument("--rounds", type=positive_int, default=rounds, help=f"timed rounds (default: {rounds})")
    parser.add_argument("--seed", type=random_seed, default=0, help="random seed, 0 <= SEED < 2**32 (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the machine and every run time as JSON")


def announce_machine() -> dict:
    """``benchmark.machine_info()``, after printing its line (what ran, and how loaded the host was)."""
    machine = machine_info()
    print(f"jax {machine['jax']}, {machine['device_count']} x {machine['device_kind']}, {machine['cpu_count']} x "
          f"{machine['cpu_model']}, load average {machine['load_average_1min']:.2f} at start", flush=True)
    return machine


def timing_mesh(cpu_device_count: int) -> tuple[Mesh, dict]:
    """(The 1-d TP mesh a timing script runs on, the machine it runs on): the CPU platform where no GPU
    exists, all accelerators or ``cpu_device_count`` CPU devices, and :func:`announce_machine`.
    CommandError when the devices cannot be had."""
    use_cpu_without_gpu()
    mesh = tp_mesh(demo_devices(cpu_device_count))
    return mesh, announce_machine()


# ---- argument types and flags ----


def mesh_decision(config: TailConfig, num_tokens: int, mesh: Mesh, weight_layout: str) -> TierDecision:
    """What :func:`select_tier` picks for a call on ``mesh`` (its TP size, device kind and platform)."""
    device = mesh.devices.flat[0]
    return select_tier(config, num_tokens, mesh.shape[AXIS_NAME], weight_layout=weight_layout,
                       device_kind=device.device_kind, platform=device.platform)


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


def cpu_device_count(text: str) -> int:
    """``text`` as a count of CPU devices to force, 1 to ``MAX_CPU_DEVICES`` (argparse type)."""
    value = positive_int(text)
    if value > MAX_CPU_DEVICES:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_CPU_DEVICES} CPU devices, got {value}")
    return value


def random_seed(text: str) -> int:
    """``text`` as a random seed numpy takes, an integer in [0, ``SEED_LIMIT``) (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32), got {text!r}")
    return value


def positive_int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers, each >= 1 (argparse type): token counts, TP sizes."""
    return tuple(positive_int(item.strip()) for item in text.split(","))


def choice_list(choices: Sequence[str], what: str):
    """An argparse type: a comma-separated list of names among ``choices`` (``what`` names them in errors)."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(item.strip() for item in text.split(","))
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(f"expected {what} among {', '.join(choices)}, got {name!r}")
        return names

    return parse


def tier_values() -> str:
    """The registry's tier values, comma-separated: "native, overlap, ..." (for help and errors)."""
    return ", ".join(tier.value for tier in Tier)


def tier_list(text: str) -> tuple[Tier, ...]:
    """A comma-separated list of tier values (argparse type)."""
    tiers = []
    for item in text.split(","):
        try:
            tiers.append(Tier.parse(item.strip()))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected tiers among {tier_values()}, got {item.strip()!r}") from None
    return tuple(tiers)


def add_weight_layout_argument(parser: argparse.ArgumentParser) -> None:
    """``--weight-layout``: where the up-projection kernel lives (default: column)."""
    parser.add_argument(
        "--weight-layout", choices=WEIGHT_LAYOUTS, default="column",
        help="where the up-projection kernel lives: column-sharded or replicated (default: column)",
    )


def add_seed_argument(parser: argparse.ArgumentParser) -> None:
    """``--seed``: of the random inputs, 0 <= SEED < 2**32."""
    parser.add_argument("--seed", type=random_seed, default=DEFAULT_SEED,
                        help=f"random seed, 0 <= SEED < 2**32 (default: {DEFAULT_SEED})")


def add_measurement_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``bench`` and ``calibrate`` share: what to measure, how often, and the tail config."""
    kimi = TailConfig.kimi_k3()
    parser.add_argument(
        "--tokens", type=positive_int_list, metavar="T,T,...",
        help=f"token counts, comma-separated (default: 1, 2, 4, ... {DEFAULT_MAX_TOKENS}; on the CPU backend "
        f"up to {CPU_MAX_TOKENS})",
    )
    parser.add_argument(
        "--tiers", type=tier_list, metavar="TIER,...",
        help=f"tiers to time, comma-separated, of {tier_values()} (default: every tier that runs with --weight-layout)",
    )
    parser.add_argument(
        "--devices", type=cpu_device_count, default=DEFAULT_CPU_DEVICES, metavar="N",
        help=f"CPU devices to make without an accelerator, at most {MAX_CPU_DEVICES} (default: "
        f"{DEFAULT_CPU_DEVICES}); with a GPU all GPUs are used",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=DEFAULT_REPEATS, metavar="N",
        help=f"timed runs per (T, tier) and TP size (default: {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--warmup", type=positive_int, default=1, metavar="N",
        help="untimed runs before them, the first of which compiles (default: 1)",
    )
    add_weight_layout_argument(parser)
    add_seed_argument(parser)
    shapes = add_shape_arguments(parser.add_argument_group("tail config (default: Kimi-K3)"))
    shapes.add_argument("--eps", type=float, default=kimi.rms_norm_eps,
                        help=f"RMSNorm epsilon (default: {kimi.rms_norm_eps:g})")
    shapes.add_argument("--scale", type=float, default=kimi.routed_scaling_factor,
                        help=f"routed_scaling_factor (default: {kimi.routed_scaling_factor:g})")
    shapes.add_argument("--no-norm", action="store_true", help="no latent RMSNorm (use_latent_norm=False)")
    shapes.add_argument("--no-shared", action="store_true", help="no shared experts (has_shared_experts=False)")
    shapes.add_argument("--reduced-routed", action="store_true",
                        help="the routed output arrives reduced, [T, L] (fused_output_is_reduced=True)")
    add_reduced_shared_argument(shapes)
    shapes.add_argument("--sequence-parallel", action="store_true",
                        help="token-sharded output (sequence_parallel=True)")
    shapes.add_argument("--all-reduce-form", choices=ALL_REDUCE_FORMS, default=kimi.all_reduce_form,
                        help="one all-reduce, reduce-scatter + all-gather, or auto: the form measured faster on the "
                        f"platform for the buffer's size and dtype (default: {kimi.all_reduce_form})")
    add_up_projection_arguments(shapes)
    add_all_reduce_quantization_arguments(shapes)


def add_reduced_shared_argument(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """``--reduced-shared``: the shared output arrives reduced (``k3_tail.reduce_shared`` before the tail)."""
    group.add_argument("--reduced-shared", action="store_true",
                       help="the shared output arrives reduced, [T, H], reduced before the tail by "
                       "k3_tail.reduce_shared (shared_output_is_reduced=True)")


def add_up_projection_arguments(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """``--up-proj-dtype`` and ``--fp8-activations``: the up projection's weights in FP8."""
    group.add_argument("--up-proj-dtype", choices=FP8_FORMATS, default=None,
                       help="store the up-projection kernel in this FP8 format, per-column scales (default: the "
                       "activation dtype)")
    group.add_argument("--fp8-activations", action="store_true",
                       help="with --up-proj-dtype: quantise the normalised latent per token too, so the GEMM "
                       "multiplies two FP8 operands (fp8_activations=True)")


def up_projection_options(args: argparse.Namespace) -> dict[str, object]:
    """The TailConfig fields ``--up-proj-dtype`` and ``--fp8-activations`` set."""
    if args.fp8_activations and args.up_proj_dtype is None:
        raise CommandError("--fp8-activations: needs --up-proj-dtype (one of " + ", ".join(FP8_FORMATS) + ")")
    return {"up_proj_dtype": args.up_proj_dtype, "fp8_activations": args.fp8_activations}


# --all-reduce-quantization's choices: "none" (no codec) and the codecs (k3_tail.ops.codecs.CODECS).
QUANTIZATION_CHOICES = tuple("none" if name is None else name for name in ALL_REDUCE_QUANTIZATIONS)


def add_all_reduce_quantization_arguments(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """``--all-reduce-quantization`` and ``--quantized-all-reduce-min-bytes``: quantised TP sums
    (vLLM ROCm's QuickReduce, :mod:`k3_tail.ops.collectives`)."""
    group.add_argument("--all-reduce-quantization", choices=QUANTIZATION_CHOICES, default="none",
                       help="send the TP sums block-quantised in this codec, as two-shot all-reduces like vLLM "
                       "ROCm's QuickReduce; changes the numerics (default: none)")
    group.add_argument("--quantized-all-reduce-min-bytes", type=non_negative_int, default=None, metavar="N",
                       help="with --all-reduce-quantization: quantise only sums of buffers of at least N bytes "
                       "(default: vLLM's minimum for the dtype and p)")


def all_reduce_quantization_options(args: argparse.Namespace) -> dict[str, object]:
    """The TailConfig fields ``--all-reduce-quantization`` and ``--quantized-all-reduce-min-bytes`` set."""
    codec = None if args.all_reduce_quantization == "none" else args.all_reduce_quantization
    if args.quantized_all_reduce_min_bytes is not None and codec is None:
        raise CommandError("--quantized-all-reduce-min-bytes: needs --all-reduce-quantization (one of "
                           + ", ".join(name for name in QUANTIZATION_CHOICES if name != "none") + ")")
    return {"all_reduce_quantization": codec, "quantized_all_reduce_min_bytes": args.quantized_all_reduce_min_bytes}


def add_shape_arguments(group: argparse._ArgumentGroup) -> argparse._ArgumentGroup:
    """``--hidden-size``, ``--latent-size`` and ``--dtype`` (Kimi-K3's by default) on ``group``; returns it."""
    kimi = TailConfig.kimi_k3()
    group.add_argument("--hidden-size", type=positive_int, default=kimi.hidden_size, metavar="H",
                       help=f"hidden size H (default: {kimi.hidden_size})")
    group.add_argument("--latent-size", type=positive_int, default=kimi.latent_size, metavar="L",
                       help=f"latent size L (default: {kimi.latent_size})")
    group.add_argument("--dtype", choices=CONFIG_DTYPES, default=kimi.dtype.name,
                       help=f"activation and weight dtype (default: {kimi.dtype.name})")
    return group


def measurement_config(args: argparse.Namespace) -> TailConfig:
    """The TailConfig the config flags describe (CommandError when TailConfig rejects them)."""
    try:
        return TailConfig(
            hidden_size=args.hidden_size, latent_size=args.latent_size, dtype=args.dtype, rms_norm_eps=args.eps,
            routed_scaling_factor=args.scale, use_latent_norm=not args.no_norm, has_shared_experts=not args.no_shared,
            fused_output_is_reduced=args.reduced_routed, shared_output_is_reduced=args.reduced_shared,
            sequence_parallel=args.sequence_parallel,
            all_reduce_form=args.all_reduce_form, **up_projection_options(args),
            **all_reduce_quantization_options(args),
        )
    except ValueError as error:
        raise CommandError(f"config: {error}") from None


def measurement_tiers(tiers: Sequence[Tier] | None, weight_layout: str, config: TailConfig) -> tuple[Tier, ...]:
    """The tiers to time (CommandError when one is repeated or cannot run with the layout or config)."""
    try:
        return check_tiers(tiers, weight_layout, config)
    except ValueError as error:  # its message starts with "tiers: "
        raise CommandError(f"--{error}") from None


def measure(
    args: argparse.Namespace, config: TailConfig, tiers: Sequence[Tier], tokens: Sequence[int],
    meshes: Sequence[Mesh],
) -> list[Measurement]:
    """Time ``tiers`` at ``tokens`` on each of ``meshes`` in turn, with the measurement flags' layout,
    repeats, warm-up and seed, and a :class:`ProgressBar` on stderr over all of it."""
    bar = ProgressBar(len(meshes) * len(tokens) * len(tiers))
    measurements = []
    for mesh in meshes:
        measurements += measure_tiers(
            config, mesh, tokens, tiers=tiers, weight_layout=args.weight_layout, repeats=args.repeats,
            warmup=args.warmup, axis_name=AXIS_NAME, seed=args.seed, on_progress=bar.step,
        )
    bar.finish()
    return measurements


# ---- output ----


class ProgressBar:
    """A text progress bar on ``stream`` (default: stderr) over ``total`` steps, with the elapsed time.

    On a terminal it redraws one line in place; elsewhere (a pipe, a CI log) it writes one line per
    step instead, because carriage returns would pile up there as one garbled line.
    """

    WIDTH = 24

    def __init__(self, total: int, stream: IO[str] | None = None):
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.interactive = self.stream.isatty()
        self.done = 0
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        """A step named ``label`` starts (the previous one, if any, is done)."""
        self._draw(label)
        self.done += 1

    def finish(self) -> None:
        """Every step is done."""
        self.done = self.total
        self._draw("done")
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, label: str) -> None:
        filled = self.WIDTH * self.done // max(self.total, 1)
        text = (f"[{'#' * filled}{'-' * (self.WIDTH - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:.0f} s  {label}")
        # "\x1b[K" erases what a longer previous label left on the line.
        self.stream.write(f"\r{text}\x1b[K" if self.interactive else f"{text}\n")
        self.stream.flush()


def progress(message: str, end: str = "\n") -> None:
    """``message`` to stderr at once, so a long run shows what it is doing."""
    print(message, end=end, file=sys.stderr, flush=True)


def format_ms(seconds: float) -> str:
    """``seconds`` in milliseconds with about 3 significant digits (0.0123, 1.23, 123)."""
    milliseconds = 1e3 * seconds
    digits = next((d for d, bound in ((4, 0.1), (3, 1), (2, 10), (1, 100)) if milliseconds < bound), 0)
    return f"{milliseconds:.{digits}f}"


def describe_config(config: TailConfig) -> str:
    """One line: the config's shapes and numerics, e.g. "H=7168, L=3584, bfloat16, eps 1e-06, scale 1"."""
    text = (f"H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}, eps {config.rms_norm_eps:g}, "
            f"scale {config.routed_scaling_factor:g}")
    minimum = config.quantized_all_reduce_min_bytes
    quantised = (f"{config.all_reduce_quantization}-quantised sums "
                 + ("(vLLM's minimum)" if minimum is None else f">= {minimum} B"))
    flags = [name for name, on in (
        ("no norm", not config.use_latent_norm), ("no shared experts", not config.has_shared_experts),
        ("reduced routed output", config.fused_output_is_reduced),
        ("reduced shared output", config.shared_output_is_reduced), ("sequence-parallel", config.sequence_parallel),
        (f"all_reduce_form {config.all_reduce_form}", config.all_reduce_form != "auto"),
        (f"up projection {getattr(config.up_proj_dtype, 'name', '')}", config.up_proj_dtype is not None),
        ("FP8 activations", config.fp8_activations),
        (quantised, config.all_reduce_quantization is not None),
    ) if on]
    return ", ".join([text, *flags])


def format_bytes(count: float) -> str:
    """``count`` bytes in the binary unit that keeps about 3 significant digits: "512 B", "12.3 KiB",
    "6.13 MiB", "1.50 GiB"."""
    value, unit = float(count), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.{_decimals(value)}f} {unit}"


def format_seconds(seconds: float) -> str:
    """``seconds`` in the unit that keeps about 3 significant digits: "812 us", "1.23 ms", "2.50 s"."""
    for scale, unit in ((1e-3, "us"), (1.0, "ms")):
        if seconds < scale:
            value = seconds / scale * 1e3
            return f"{value:.{_decimals(value)}f} {unit}"
    return f"{seconds:.{_decimals(seconds)}f} s"


def _decimals(value: float) -> int:
    """Decimals that show about 3 significant digits of ``value`` (at least 1, under 1000)."""
    return 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0


def format_percent(fraction: float) -> str:
    """``fraction`` as a percentage: one decimal under 10% ("0.4%", "7.1%"), none above ("23%")."""
    percent = 100 * fraction
    return f"{percent:.1f}%" if abs(percent) < 10 else f"{percent:.0f}%"


def within_noise(a: Timing, b: Timing) -> bool:
    """Whether two timings' q25-q75 ranges overlap: the runs cannot tell which of the two is faster."""
    return a.q25_s <= b.q75_s and b.q25_s <= a.q75_s


def format_vs_fastest(timing: Timing, fastest: Timing) -> str:
    """One tier's median against the fastest's at the same call: "fastest", or how much slower ("+7.1%")."""
    if timing is fastest:
        return "fastest"
    return f"+{format_percent(timing.median_s / fastest.median_s - 1)}"


def format_selection_gap(selected: Tier, timings: Mapping[Tier, Timing]) -> str:
    """How far the selected tier is from the fastest of ``timings`` (the tiers timed at one call):
    "selected native, fastest overlap: selection 7.1% slower (412 us vs 385 us)", "within noise" when
    their q25-q75 ranges overlap; "selected overlap, the fastest"; or "selected overlap (not timed)"."""
    fastest = min(timings, key=lambda tier: timings[tier].median_s)
    if selected not in timings:
        return f"selected {selected.value} (not timed), fastest {fastest.value}"
    if selected == fastest:
        return f"selected {selected.value}, the fastest"
    mine, best = timings[selected], timings[fastest]
    noise = ", within noise: their q25-q75 ranges overlap" if within_noise(mine, best) else ""
    return (f"selected {selected.value}, fastest {fastest.value}: selection "
            f"{format_percent(mine.median_s / best.median_s - 1)} slower ({format_seconds(mine.median_s)} vs "
            f"{format_seconds(best.median_s)}{noise})")


def format_bench_table(measurements: Sequence[Measurement], config: TailConfig, *, device_kind: str) -> str:
    """The table of ``bench`` and ``calibrate``: one row per (p, T, tier) with the median, the q25-q75
    spread (ms), the speedup over native at the same (p, T) (median over median; "-" when native
    was not timed) and the median against the fastest tier's there. A "*" marks the tier select_tier
    picks for that call (``config``, T, p, layout, ``device_kind``); after each (p, T) a line says how
    far that pick is from the fastest (:func:`format_selection_gap`)."""
    blocks: dict[tuple[int, int], list[Measurement]] = {}
    for m in measurements:
        blocks.setdefault((m.tp_size, m.num_tokens), []).append(m)
    lines = [f"{'p':>4}{'T':>7}  {'tier':<16}{'median ms':>11}{'q25-q75 ms':>19}{'vs native':>11}{'vs fastest':>12}"]
    for (tp_size, num_tokens), block in blocks.items():
        if len(lines) > 1:
            lines.append("")
        timings = {m.tier: m.timing for m in block}
        fastest = min(timings.values(), key=lambda timing: timing.median_s)
        native = timings.get(Tier.NATIVE)
        selection = select_tier(config, num_tokens, tp_size, weight_layout=block[0].weight_layout,
                                device_kind=device_kind)
        for m in block:
            speedup = "-" if native is None else f"{native.median_s / m.timing.median_s:.2f}x"
            spread = f"{format_ms(m.timing.q25_s)}-{format_ms(m.timing.q75_s)}"
            selected = " *" if selection.tier == m.tier else ""
            lines.append(f"{tp_size:>4}{num_tokens:>7}  {m.tier.value:<16}{format_ms(m.timing.median_s):>11}"
                         f"{spread:>19}{speedup:>11}{format_vs_fastest(m.timing, fastest):>12}{selected}")
        lines.append(f"{'':>11}p={tp_size} T={num_tokens}: {format_selection_gap(selection.tier, timings)}")
    lines += ["", "* the tier select_tier picks for that call (config, T, p, layout, device kind)",
              "vs fastest: the median against the fastest tier's at that (p, T)"]
    return "\n".join(lines)


def terminal_width() -> int | None:
    """The width to fit output to: ``COLUMNS`` when set, else that of the terminal stdout is on
    (``shutil.get_terminal_size``); None off a terminal (a pipe, a file), where lines may be long."""
    if not os.environ.get("COLUMNS") and not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, width: int | None,
                 right: Collection[int] = ()) -> str:
    """``rows`` under ``header`` as plain text that fits in ``width`` characters (None: any width;
    :func:`terminal_width` gives the terminal's): columns two spaces apart, the columns in ``right``
    (figures) right-aligned. When the natural widths do not fit, the widest columns of text narrow
    and their cells wrap at spaces, down to their longest word; figures never wrap. Rows then stand
    a blank line apart, so a wrapped row reads as one. Where even that is too wide, each row becomes
    a block of "label: value" lines (:func:`format_blocks`)."""
    columns = list(zip(header, *rows, strict=True))
    widths = [max(map(len, column)) for column in columns]
    words = [max(len(word) for cell in column for word in cell.split() or [""]) for column in columns]
    budget = sum(widths) if width is None else width - len(TABLE_GAP) * (len(widths) - 1)
    while sum(widths) > budget:
        narrowable = [index for index in range(len(widths)) if index not in right and widths[index] > words[index]]
        if not narrowable:
            return format_blocks(header, rows, width=width)
        widths[max(narrowable, key=widths.__getitem__)] -= 1
    wrapped = [[textwrap.wrap(cell, column_width, break_on_hyphens=False) or [""]
                for cell, column_width in zip(row, widths, strict=True)] for row in (header, *rows)]
    spaced = any(len(lines) > 1 for row in wrapped[1:] for lines in row)

    def text_lines(cells: list[list[str]]) -> list[str]:
        return [TABLE_GAP.join(
            (str.rjust if index in right else str.ljust)(lines[line] if line < len(lines) else "", widths[index])
            for index, lines in enumerate(cells)).rstrip() for line in range(max(map(len, cells)))]

    lines = [*text_lines(wrapped[0]), TABLE_GAP.join("-" * column_width for column_width in widths)]
    for index, cells in enumerate(wrapped[1:]):
        lines += [""] * (spaced and index > 0) + text_lines(cells)
    return "\n".join(lines)


def format_blocks(header: Sequence[str], rows: Sequence[Sequence[str]], *, width: int) -> str:
    """``rows`` as blocks a blank line apart, for a terminal too narrow for their table: the first
    cell, then one "label: value" line per other cell, indented, wrapped to ``width``."""
    blocks = []
    for row in rows:
        lines = textwrap.wrap(row[0], width, break_on_hyphens=False) or [""]
        for label, cell in zip(header[1:], row[1:], strict=True):
            lines += textwrap.wrap(f"{label}: {cell}", width, initial_indent="  ", subsequent_indent="    ",
                                   break_on_hyphens=False)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Collection[int] = ()) -> str:
    """``rows`` under ``header`` as a Markdown table (a "|" in a cell escaped), the columns in ``right``
    right-aligned."""
    rule = ["---:" if index in right else "---" for index in range(len(header))]
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
                     for row in (header, rule, *rows))
