"""What the commands that time the tiers share: ``bench`` and ``calibrate`` their flags (what to time, how
often, and the tail config, every field a flag: :func:`add_measurement_arguments`), their checks
(:func:`measurement_config`, :func:`measurement_tiers`) and their run (:func:`measure`); ``demo`` too
the tiers it leaves untimed (:func:`untimed_tiers`). Their table is :func:`k3_tail.cli.tables.format_bench_table`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from jax.sharding import Mesh

from k3_tail.cli.harness import (
    AXIS_NAME,
    CommandError,
    ProgressBar,
    add_all_reduce_quantization_arguments,
    add_devices_argument,
    add_reduced_shared_argument,
    add_repeats_argument,
    add_seed_argument,
    add_shape_arguments,
    add_up_projection_arguments,
    add_warmup_argument,
    add_weight_layout_argument,
    all_reduce_quantization_options,
    positive_int_list,
    tier_list,
    tier_values,
    up_projection_options,
)
from k3_tail.config import TailConfig
from k3_tail.ops.collectives import ALL_REDUCE_FORMS
from k3_tail.tiers.registry import Tier
from k3_tail.tools.benchmark import CPU_MAX_TOKENS, DEFAULT_MAX_TOKENS, Measurement, check_tiers, measure_tiers

DEFAULT_REPEATS = 5


def add_measurement_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``bench`` and ``calibrate`` share: what to measure, how often, and the tail config."""
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
    add_repeats_argument(parser, DEFAULT_REPEATS, "timed runs per (T, tier) and TP size")
    add_warmup_argument(parser, 1)
    add_weight_layout_argument(parser)
    add_seed_argument(parser)
    add_config_arguments(parser.add_argument_group("tail config (default: Kimi-K3)"))


def add_config_arguments(group: argparse._ArgumentGroup) -> None:
    """Every TailConfig field as a flag on ``group``, Kimi-K3's by default (:func:`measurement_config` reads them)."""
    kimi = TailConfig.kimi_k3()
    add_shape_arguments(group)
    group.add_argument("--eps", type=float, default=kimi.rms_norm_eps,
                       help=f"RMSNorm epsilon (default: {kimi.rms_norm_eps:g})")
    group.add_argument("--scale", type=float, default=kimi.routed_scaling_factor,
                       help=f"routed_scaling_factor (default: {kimi.routed_scaling_factor:g})")
    group.add_argument("--no-norm", action="store_true", help="no latent RMSNorm (use_latent_norm=False)")
    group.add_argument("--no-shared", action="store_true", help="no shared experts (has_shared_experts=False)")
    group.add_argument("--reduced-routed", action="store_true",
                       help="the routed output arrives reduced, [T, L] (routed_output_is_reduced=True)")
    add_reduced_shared_argument(group)
    group.add_argument("--sequence-parallel", action="store_true", help="token-sharded output (sequence_parallel=True)")
    # A metavar, not the choices, in the usage line: they are too long a word to wrap at 80 columns.
    group.add_argument("--all-reduce-form", choices=ALL_REDUCE_FORMS, default=kimi.all_reduce_form, metavar="FORM",
                       help="how each sum travels: all-reduce, reduce-scatter+all-gather, or auto: the form "
                       f"measured faster on the platform for the buffer's size and dtype (default: "
                       f"{kimi.all_reduce_form})")
    add_up_projection_arguments(group)
    add_all_reduce_quantization_arguments(group)


def measurement_config(args: argparse.Namespace) -> TailConfig:
    """The TailConfig :func:`add_config_arguments`' flags describe (CommandError when TailConfig rejects them)."""
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
