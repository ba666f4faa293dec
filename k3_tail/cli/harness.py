"""The command-line harness of the ``k3-tail`` commands, of the Kimi-K3 model's commands and of the experiments
in scripts/: argument types and the flags they share, the tail config as flags, devices and the TP mesh,
progress, one-line errors and an experiment's JSON. Tables and figures are :mod:`k3_tail.cli.tables`'s.

Devices: a command runs on a 1-d TP mesh (axis ``AXIS_NAME``) of every accelerator, or without one of
``--devices`` CPU devices (at most ``MAX_CPU_DEVICES``: JAX builds every forced CPU device before its first
output). JAX takes the CPU device count only before its backend starts, so :func:`demo_devices` sets it
before anything else touches JAX. Without ``JAX_PLATFORMS`` and without a GPU device node,
:func:`use_cpu_without_gpu` selects the CPU platform first: an installed GPU plugin would otherwise print its
failed start (a cuDNN traceback) before JAX falls back to the CPU.

Flags, declared once: ``--devices N``, ``--repeats N`` (an experiment's also spelt ``--rounds``: timed runs or
interleaved rounds), ``--warmup N``, ``--seed S`` (an integer in [0, 2**32), what numpy takes), the tail
config's that several commands take (every field as a flag: :mod:`k3_tail.cli.measurement`) and an
experiment's ``--json FILE`` (:class:`Experiment`; ``-``: stdout, the tables then go to stderr; a file is
checked as the flags are parsed, before any work, and written whole or not at all). A failure to report is a
:class:`CommandError`: one line, exit status 2. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import re
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any

import jax
import numpy as np
from jax.sharding import Mesh

from k3_tail.config import ALL_REDUCE_QUANTIZATIONS, TailConfig
from k3_tail.ops.columns import WEIGHT_LAYOUTS
from k3_tail.ops.up_projection import FP8_FORMATS
from k3_tail.output_files import check_output_file, write_file
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.rules import select_tier
from k3_tail.tiers.registry import Tier
from k3_tail.tools.benchmark import machine_info

PROG = "k3-tail"
AXIS_NAME = "tp"
DEFAULT_CPU_DEVICES = 8
MAX_CPU_DEVICES = 512
SEED_LIMIT = 2**32
DEFAULT_SEED = 0
CONFIG_DTYPES = ("bfloat16", "float16", "float32")
# Device nodes whose presence means a GPU backend can start (CUDA, ROCm).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")
# --all-reduce-quantization's choices: "none" (no codec) and the codecs (k3_tail.ops.codecs.CODECS).
QUANTIZATION_CHOICES = tuple("none" if name is None else name for name in ALL_REDUCE_QUANTIZATIONS)
MIN_BYTES_NEEDS_CODEC = ("--quantized-all-reduce-min-bytes: needs --all-reduce-quantization (one of "
                         + ", ".join(name for name in QUANTIZATION_CHOICES if name != "none") + ")")
# A line of help text that sets a label off from its text by two or more spaces ("  accessed  bytes ..."):
# its wrapped lines continue under the text.
_LABELLED_LINE = re.compile(r"^( *\S+(?: \S+)*  +)\S")


class CommandError(Exception):
    """A failure to report to the user in one line (no traceback), with exit status 2."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, wrapped to the terminal's width as argparse measures it (``COLUMNS``, else the
    terminal's, else 80), that keeps the line breaks of a description or epilog: each of its lines is
    wrapped on its own, continuing under its text (after its indent, or after a label that two or more
    spaces set off). Text without line breaks wraps as argparse wraps it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(self._fill_line(line, width, indent) for line in text.splitlines())

    @staticmethod
    def _fill_line(line: str, width: int, indent: str) -> str:
        if not line.strip():
            return ""
        labelled = _LABELLED_LINE.match(line)
        hanging = len(labelled.group(1)) if labelled else len(line) - len(line.lstrip())
        return textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent + " " * hanging,
                             break_on_hyphens=False, break_long_words=False, replace_whitespace=False,
                             drop_whitespace=True)


# ---- devices ----


def use_cpu_without_gpu() -> None:
    """Select JAX's CPU platform when the user chose none and no GPU device node exists (module
    docstring). Does nothing once JAX's backends are up, or when ``JAX_PLATFORMS`` is set."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    if any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass  # the backend is already initialised: nothing left to protect


def demo_devices(cpu_device_count: int, *, accelerators: bool = True) -> list[jax.Device]:
    """All accelerators (when ``accelerators`` and the default backend is one), else
    ``cpu_device_count`` CPU devices; CommandError when JAX already started with fewer."""
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


def mesh_decision(config: TailConfig, num_tokens: int, mesh: Mesh, weight_layout: str) -> TierDecision:
    """What :func:`~k3_tail.selection.rules.select_tier` picks for a call on ``mesh`` (its TP size, device kind
    and platform)."""
    device = mesh.devices.flat[0]
    return select_tier(config, num_tokens, mesh.shape[AXIS_NAME], weight_layout=weight_layout,
                       device_kind=device.device_kind, platform=device)


def announce_machine(stream: IO[str] | None = None) -> dict:
    """``benchmark.machine_info()``, after printing its line (what ran, and how loaded the host was)."""
    machine = machine_info()
    print(f"jax {machine['jax']}, {machine['device_count']} x {machine['device_kind']}, {machine['cpu_count']} x "
          f"{machine['cpu_model']}, load average {machine['load_average_1min']:.2f} at start", file=stream, flush=True)
    return machine


# ---- argument types ----


def bounded_int(text: str, minimum: int) -> int:
    """``text`` as an integer >= ``minimum``, else argparse.ArgumentTypeError."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """``text`` as an integer >= 1 (argparse type)."""
    return bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    """``text`` as an integer >= 0 (argparse type)."""
    return bounded_int(text, 0)


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


def choice_list(choices: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
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


# ---- the flags every command and experiment declares alike ----


def add_devices_argument(parser: argparse.ArgumentParser, what: str, gpus: str | None = None) -> None:
    """``--devices N``, the CPU devices to force (:func:`cpu_device_count`), on ``parser``: its help says
    ``what`` they are for, the maximum and the default, then ``gpus`` (what happens with GPUs) if given."""
    after = "" if gpus is None else f"; {gpus}"
    parser.add_argument("--devices", type=cpu_device_count, default=DEFAULT_CPU_DEVICES, metavar="N",
                        help=f"{what}, at most {MAX_CPU_DEVICES} (default: {DEFAULT_CPU_DEVICES}){after}")


def add_repeats_argument(parser: argparse.ArgumentParser, default: int, runs: str, *, rounds: bool = False) -> None:
    """``--repeats N`` (also spelt ``--rounds`` with ``rounds``) on ``parser``: how many ``runs`` (its help)."""
    names = ("--repeats", "--rounds") if rounds else ("--repeats",)
    parser.add_argument(*names, dest="repeats", type=positive_int, default=default, metavar="N",
                        help=f"{runs} (default: {default})")


def add_warmup_argument(parser: argparse.ArgumentParser, default: int) -> None:
    """``--warmup N`` on ``parser``: untimed runs of each call before the timed ones."""
    parser.add_argument("--warmup", type=positive_int, default=default, metavar="N",
                        help=f"untimed runs of each call first, the first compiling (default: {default})")


def add_seed_argument(parser: argparse.ArgumentParser) -> None:
    """``--seed S``, of the random inputs (:func:`random_seed`), on ``parser``."""
    parser.add_argument("--seed", type=random_seed, default=DEFAULT_SEED,
                        help=f"random seed, 0 <= SEED < 2**32 (default: {DEFAULT_SEED})")


def check_output_flag(flag: str, path: str) -> None:
    """CommandError naming ``flag`` unless a file can be written at ``path``
    (:func:`k3_tail.output_files.check_output_file`), asked before anything is measured."""
    try:
        check_output_file(flag, path)
    except ValueError as error:
        raise CommandError(str(error)) from None


# ---- the tail config's flags that several commands take ----


def add_weight_layout_argument(parser: argparse.ArgumentParser) -> None:
    """``--weight-layout``: where the up-projection kernel lives (default: column)."""
    parser.add_argument(
        "--weight-layout", choices=WEIGHT_LAYOUTS, default="column",
        help="where the up-projection kernel lives: column-sharded or replicated (default: column)",
    )


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
        raise CommandError(MIN_BYTES_NEEDS_CODEC)
    return {"all_reduce_quantization": codec, "quantized_all_reduce_min_bytes": args.quantized_all_reduce_min_bytes}


# ---- the experiment ----


class Experiment:
    """One experiment's command line and output.

    ``Experiment(__doc__, repeats=5)`` declares the common flags (module docstring): ``--devices``
    unless ``devices=False``, ``--repeats``/``--rounds`` when ``repeats`` is its default, ``--warmup``
    when ``warmup`` is, and always ``--seed`` and ``--json``; ``parser`` takes the experiment's own.
    :meth:`parse` reads them, :meth:`mesh` makes the devices, :meth:`finish` prints the elapsed time and
    writes the JSON (the machine, the settings and what the experiment passes).
    """

    def __init__(self, doc: str, *, devices: bool = True, repeats: int | None = None, warmup: int | None = None):
        self.parser = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0])
        self.started = time.perf_counter()
        self.machine: dict | None = None
        if devices:
            add_devices_argument(self.parser, "CPU devices to make without a GPU", "with GPUs all GPUs are used")
        if repeats is not None:
            add_repeats_argument(self.parser, repeats, "timed runs, or interleaved rounds each running every call once",
                                 rounds=True)
        if warmup is not None:
            add_warmup_argument(self.parser, warmup)
        add_seed_argument(self.parser)
        self.parser.add_argument("--json", metavar="FILE",
                                 help="also write the machine, the settings and every result ('-': stdout)")

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """The parsed flags (also ``self.args``); a usage error exits with status 2, and so does a ``--json``
        file that cannot be written (:func:`check_output_flag`), before any work."""
        self.args = self.parser.parse_args(argv)
        self.out = sys.stderr if self.args.json == "-" else sys.stdout
        if self.args.json and self.args.json != "-":
            try:
                check_output_flag("--json", self.args.json)
            except CommandError as error:
                self.error(str(error))
        return self.args

    def error(self, message: str) -> None:
        """Exit with status 2 and ``message`` in one line (no usage)."""
        self.parser.exit(2, f"{self.parser.prog}: error: {message}\n")

    def mesh(self, *, accelerators: bool = True) -> Mesh:
        """The TP mesh of every accelerator (unless ``accelerators=False``) or ``--devices`` CPU devices,
        after announcing the machine."""
        if not accelerators:
            try:
                jax.config.update("jax_platforms", "cpu")  # no GPU plugin's start-up, not even a failed one
            except RuntimeError:
                pass  # the backend is already up: demo_devices takes its CPU devices
        use_cpu_without_gpu()
        try:
            mesh = tp_mesh(demo_devices(self.args.devices, accelerators=accelerators))
        except CommandError as error:
            self.error(str(error))
        self.machine = announce_machine(self.out)
        return mesh

    def print(self, *lines: str) -> None:
        """``lines`` on the output (stdout, or stderr with ``--json -``)."""
        print(*lines, sep="\n", file=self.out, flush=True)

    def finish(self, **results: Any) -> int:
        """Print the elapsed time and the load average, write ``--json`` (machine, settings, elapsed and
        ``results``; a file written whole or not at all, :func:`k3_tail.output_files.write_file`); returns 0,
        the exit status."""
        elapsed = time.perf_counter() - self.started
        self.print("", f"elapsed {elapsed:.0f} s; load average {os.getloadavg()[0]:.2f} at end")
        if self.args.json:
            settings = {name: value for name, value in vars(self.args).items() if name != "json"}
            report = plain({"machine": self.machine or machine_info(), "settings": settings, "elapsed_s": elapsed,
                            **results})
            text = json.dumps(report, indent=1) + "\n"
            if self.args.json == "-":
                sys.stdout.write(text)
            else:
                try:
                    write_file("--json", self.args.json, text)
                except ValueError as error:  # the path changed since parse checked it
                    self.error(str(error))
                self.print(f"wrote {self.args.json}")
        return 0


def plain(value: Any) -> Any:
    """``value`` as JSON data: dataclasses as dicts, enums by value, tuples as lists, numpy scalars as numbers."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


# ---- progress ----


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


def stepped(items: Iterable[Any], label: Callable[[Any], str]) -> Iterator[Any]:
    """``items`` one at a time, with a :class:`ProgressBar` on stderr that names each ``label(item)``."""
    items = list(items)
    bar = ProgressBar(len(items))
    for item in items:
        bar.step(label(item))
        yield item
    bar.finish()


def progress(message: str, end: str = "\n") -> None:
    """``message`` to stderr at once, so a long run shows what it is doing."""
    print(message, end=end, file=sys.stderr, flush=True)
