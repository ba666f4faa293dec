"""What the commands share beyond the experiment harness: the measurement flags, the tail config
they describe, and what a measurement table says about the selection.

Devices, argument types, progress and ``CommandError`` are the harness's
(:mod:`k3_tail.tools.experiment`), figures and tables :mod:`k3_tail.tools.tables`'s; the commands
import them from there. ``bench`` and ``calibrate`` share their measurement flags
(:func:`add_measurement_arguments`: what to time, how often, and the tail config), their checks
(:func:`measurement_config`, :func:`measurement_tiers`), their run (:func:`measure`) and their table
(:func:`format_bench_table`).
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh

from k3_tail.config import ALL_REDUCE_QUANTIZATIONS, TailConfig
from k3_tail.ops.collectives import ALL_REDUCE_FORMS
from k3_tail.ops.columns import WEIGHT_LAYOUTS
from k3_tail.ops.up_projection import FP8_FORMATS
from k3_tail.output_files import check_output_file
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.rules import select_tier
from k3_tail.tiers.registry import Tier
from k3_tail.tools.benchmark import CPU_MAX_TOKENS, DEFAULT_MAX_TOKENS, Measurement, Timing, check_tiers, measure_tiers
from k3_tail.tools.experiment import (
    AXIS_NAME,
    CommandError,
    ProgressBar,
    add_devices_argument,
    add_seed_argument,
    add_shape_arguments,
    non_negative_int,
    positive_int,
    positive_int_list,
    tier_list,
    tier_values,
)
from k3_tail.tools.tables import format_ms, format_percent, quartiles_ms, within_noise
from k3_tail.units import format_seconds

PROG = "k3-tail"

DEFAULT_REPEATS = 5
# A line of help text that sets a label off from its text by two or more spaces ("  accessed  bytes ..."):
# its wrapped lines continue under the text.
_LABELLED_LINE = re.compile(r"^( *\S+(?: \S+)*  +)\S")


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


# ---- argument types and flags ----


def mesh_decision(config: TailConfig, num_tokens: int, mesh: Mesh, weight_layout: str) -> TierDecision:
    """What :func:`select_tier` picks for a call on ``mesh`` (its TP size, device kind and platform)."""
    device = mesh.devices.flat[0]
    return select_tier(config, num_tokens, mesh.shape[AXIS_NAME], weight_layout=weight_layout,
                       device_kind=device.device_kind, platform=device)


def add_weight_layout_argument(parser: argparse.ArgumentParser) -> None:
    """``--weight-layout``: where the up-projection kernel lives (default: column)."""
    parser.add_argument(
        "--weight-layout", choices=WEIGHT_LAYOUTS, default="column",
        help="where the up-projection kernel lives: column-sharded or replicated (default: column)",
    )


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
    add_devices_argument(parser, "CPU devices to make without an accelerator", "with a GPU all GPUs are used")
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
                        help="the routed output arrives reduced, [T, L] (routed_output_is_reduced=True)")
    add_reduced_shared_argument(shapes)
    shapes.add_argument("--sequence-parallel", action="store_true",
                        help="token-sharded output (sequence_parallel=True)")
    # A metavar, not the choices, in the usage line: they are too long a word to wrap at 80 columns.
    shapes.add_argument("--all-reduce-form", choices=ALL_REDUCE_FORMS, default=kimi.all_reduce_form, metavar="FORM",
                        help="how each sum travels: all-reduce, reduce-scatter+all-gather, or auto: the form "
                        f"measured faster on the platform for the buffer's size and dtype (default: "
                        f"{kimi.all_reduce_form})")
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


def check_output_flag(flag: str, path: str) -> None:
    """CommandError naming ``flag`` unless a file can be written at ``path``
    (:func:`k3_tail.output_files.check_output_file`), asked before anything is measured."""
    try:
        check_output_file(flag, path)
    except ValueError as error:
        raise CommandError(str(error)) from None


def measurement_config(args: argparse.Namespace) -> TailConfig:
    """The TailConfig the config flags describe (CommandError when TailConfig rejects them)."""
    try:
        return TailConfig(
            hidden_size=args.hidden_size, latent_size=args.latent_size, dtype=args.dtype, rms_norm_eps=args.eps,
            routed_scaling_factor=args.scale, use_latent_norm=not args.no_norm, has_shared_experts=not args.no_shared,
            routed_output_is_reduced=args.reduced_routed, shared_output_is_reduced=args.reduced_shared,
            sequence_parallel=args.sequence_parallel,
            all_reduce_form=args.all_reduce_form, **up_projection_options(args),
            **all_reduce_quantization_options(args),
        )
    except ValueError as error:
        raise CommandError(f"config: {error}") from None


def measurement_tiers(tiers: Sequence[Tier] | None, weight_layout: str, config: TailConfig,
                      platform: str | None) -> tuple[Tier, ...]:
    """The tiers to time on devices of ``platform`` (CommandError when one is repeated or cannot run with
    the layout or config); by default every tier that runs, and runs compiled there."""
    try:
        return check_tiers(tiers, weight_layout, config, platform=platform)
    except ValueError as error:  # its message starts with "tiers: "
        raise CommandError(f"--{error}") from None


def untimed_tiers(config: TailConfig, weight_layout: str, platform: str | None) -> list[str]:
    """Why each tier left out of the default measurement is left out, one line each: it cannot run with the
    layout or config, or its kernel runs interpreted on ``platform`` (nothing to time)."""
    lines = []
    for tier in Tier:
        reason = tier.why_not(weight_layout, config)
        if reason is None and tier.record.runs_interpreted_on(platform):
            reason = (f"{tier.value}'s Pallas kernel runs interpreted on {platform} (compiled on GPUs only): "
                      "nothing to time here")
        if reason is not None:
            lines.append(reason)
    return lines


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


def describe_config(config: TailConfig) -> str:
    """One line: the config's shapes and numerics, e.g. "H=7168, L=3584, bfloat16, eps 1e-06, scale 1"."""
    text = (f"H={config.hidden_size}, L={config.latent_size}, {config.dtype.name}, eps {config.rms_norm_eps:g}, "
            f"scale {config.routed_scaling_factor:g}")
    minimum = config.quantized_all_reduce_min_bytes
    quantised = (f"{config.all_reduce_quantization}-quantised sums "
                 + ("(vLLM's minimum)" if minimum is None else f">= {minimum} B"))
    flags = [name for name, on in (
        ("no norm", not config.use_latent_norm), ("no shared experts", not config.has_shared_experts),
        ("reduced routed output", config.routed_output_is_reduced),
        ("reduced shared output", config.shared_output_is_reduced), ("sequence-parallel", config.sequence_parallel),
        (f"all_reduce_form {config.all_reduce_form}", config.all_reduce_form != "auto"),
        (f"up projection {getattr(config.up_proj_dtype, 'name', '')}", config.up_proj_dtype is not None),
        ("FP8 activations", config.fp8_activations),
        (quantised, config.all_reduce_quantization is not None),
    ) if on]
    return ", ".join([text, *flags])


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


def selected_tiers(measurements: Sequence[Measurement], config: TailConfig, *,
                   device: jax.Device) -> dict[tuple[int, int, str], TierDecision]:
    """What select_tier picks for each call of ``measurements`` (``config``, T, p, layout, on ``device``'s kind
    and platform), by (p, T, weight layout): the tier the bench table stars and its plot rings."""
    return {key: select_tier(config, key[1], key[0], weight_layout=key[2], device_kind=device.device_kind,
                             platform=device)
            for key in dict.fromkeys((m.tp_size, m.num_tokens, m.weight_layout) for m in measurements)}


def format_bench_table(measurements: Sequence[Measurement], config: TailConfig, *, device: jax.Device) -> str:
    """The table of ``bench`` and ``calibrate``: one row per (p, T, tier) with the median, the q25-q75
    spread (ms), the speedup over native at the same (p, T) (median over median; "-" when native
    was not timed) and the median against the fastest tier's there. A "*" marks the tier select_tier
    picks for that call (``config``, T, p, layout, ``device``'s kind and platform); after each (p, T) a line says how
    far that pick is from the fastest (:func:`format_selection_gap`)."""
    blocks: dict[tuple[int, int], list[Measurement]] = {}
    for m in measurements:
        blocks.setdefault((m.tp_size, m.num_tokens), []).append(m)
    selections = selected_tiers(measurements, config, device=device)
    lines = [f"{'p':>4}{'T':>7}  {'tier':<16}{'median ms':>11}{'q25-q75 ms':>19}{'vs native':>11}{'vs fastest':>12}"]
    for (tp_size, num_tokens), block in blocks.items():
        if len(lines) > 1:
            lines.append("")
        timings = {m.tier: m.timing for m in block}
        fastest = min(timings.values(), key=lambda timing: timing.median_s)
        native = timings.get(Tier.NATIVE)
        selection = selections[(tp_size, num_tokens, block[0].weight_layout)]
        for m in block:
            speedup = "-" if native is None else f"{native.median_s / m.timing.median_s:.2f}x"
            spread = quartiles_ms(m.timing)
            selected = " *" if selection.tier == m.tier else ""
            lines.append(f"{tp_size:>4}{num_tokens:>7}  {m.tier.value:<16}{format_ms(m.timing.median_s):>11}"
                         f"{spread:>19}{speedup:>11}{format_vs_fastest(m.timing, fastest):>12}{selected}")
        lines.append(f"{'':>11}p={tp_size} T={num_tokens}: {format_selection_gap(selection.tier, timings)}")
    lines += ["", "* the tier select_tier picks for that call (config, T, p, layout, device kind)",
              "vs fastest: the median against the fastest tier's at that (p, T)"]
    return "\n".join(lines)
