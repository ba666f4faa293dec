"""``k3-tail demo``: the Kimi-K3 tail on every tier, checked against native and timed.

Runs the Kimi-K3 tail (H=7168, L=3584, bf16) on a TP mesh (all GPUs, or ``--devices`` CPU devices, at
most ``MAX_CPU_DEVICES`` = 512: :func:`k3_tail.cli.harness.demo_devices`) for a few token counts, on
every tier that runs with the kernel layout, and prints a table: for each token count T the tier
:func:`k3_tail.select_tier` picks and why, for each tier its error against the native tier, its median
run time and how much slower it is than the fastest tier, and a line on how far the selected tier
is from the fastest. Where the selection's rules are vLLM's GPU thresholds and the devices are no GPUs
(the CPU mesh), one line before the table says so and how to calibrate
(:func:`k3_tail.selection.rules.gpu_rules_note`); the table's reasons leave that note out.

Inputs are random with a fixed seed and are placed on the mesh once, the weights before the first
token count and each T's partials before its runs, so the times measure the tail, not host
transfers. Each (T, tier) runs once to compile (the warm-up), then ``--repeats`` timed runs. The
exit status is 1 when some tier is further than ``RELATIVE_ERROR_TOLERANCE`` from native (relative
Frobenius error; ``FP8_ACTIVATIONS_TOLERANCE`` with ``--fp8-activations``; plus two codec steps,
2 / 2^(b-1), with ``--all-reduce-quantization``), 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from k3_tail.cli.harness import (
    AXIS_NAME,
    CommandError,
    add_all_reduce_quantization_arguments,
    add_devices_argument,
    add_repeats_argument,
    add_seed_argument,
    add_up_projection_arguments,
    add_weight_layout_argument,
    all_reduce_quantization_options,
    demo_devices,
    mesh_decision,
    positive_int_list,
    progress,
    tp_mesh,
    up_projection_options,
)
from k3_tail.cli.measurement import DEFAULT_REPEATS, untimed_tiers
from k3_tail.cli.tables import describe_config, format_selection_gap, format_vs_fastest
from k3_tail.config import TailConfig
from k3_tail.forward import tail_forward
from k3_tail.hardware import device_platform
from k3_tail.ops.codecs import CODECS
from k3_tail.selection.decision import TierDecision
from k3_tail.selection.rules import gpu_rules_note
from k3_tail.tiers.registry import Tier
from k3_tail.tools.benchmark import Timing, place_partials, place_weights, tiers_for, time_runs

DEFAULT_TOKEN_COUNTS = (1, 16, 64, 320)
# bf16 keeps 8 significand bits: tiers that sum and round in another order differ by a few 1e-3.
RELATIVE_ERROR_TOLERANCE = 1e-2
# With --fp8-activations each tier rounds its GEMM input to FP8 per token (one_shot its own partial,
# the others the reduced latent): about 2e-2 from the exact result each (scripts/fp8_error.py).
FP8_ACTIVATIONS_TOLERANCE = 5e-2

HELP = "run every tier on Kimi-K3 shapes, check it against native, time it"
DESCRIPTION = ("Run the Kimi-K3 tail (H=7168, L=3584, bf16) on every tier for a few token counts; print the tier "
               "select_tier picks and why, each tier's error against native and its median time.")


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """``demo``'s flags: token counts, repeats, devices, layout, seed, FP8 and quantised sums."""
    demo.add_argument(
        "--tokens", type=positive_int_list, default=DEFAULT_TOKEN_COUNTS, metavar="T,T,...",
        help=f"token counts to run, comma-separated (default: {','.join(map(str, DEFAULT_TOKEN_COUNTS))})",
    )
    add_repeats_argument(demo, DEFAULT_REPEATS, "timed runs per (T, tier) after the warm-up run")
    add_devices_argument(demo, "CPU devices to make, the TP size without an accelerator",
                         "with a GPU all GPUs are used")
    add_weight_layout_argument(demo)
    add_seed_argument(demo)
    add_up_projection_arguments(demo)
    add_all_reduce_quantization_arguments(demo)


def run(args: argparse.Namespace) -> int:
    """The ``demo`` command: see the module docstring. Returns 1 when a tier disagrees with native."""
    try:
        config = TailConfig.kimi_k3(**up_projection_options(args), **all_reduce_quantization_options(args))
    except ValueError as error:
        raise CommandError(f"config: {error}") from None
    devices = demo_devices(args.devices)
    mesh = tp_mesh(devices)
    tp_size = mesh.shape[AXIS_NAME]
    rng = np.random.default_rng(args.seed)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices")
    print(f"mesh: {AXIS_NAME}={tp_size} over {len(devices)} {devices[0].platform} devices")
    print(
        f"config: Kimi-K3 tail, {describe_config(config)}, "
        f"overlap_token_threshold={config.overlap_token_threshold}; kernel layout {args.weight_layout}"
    )
    print(
        f"runs: 1 warm-up + {args.repeats} timed per (T, tier), T in {', '.join(map(str, args.tokens))}; "
        f"seed {args.seed}"
    )
    # Said once here, not in every T's reason.
    gpu_rules = gpu_rules_note(config, device_platform(devices[0]))
    if gpu_rules is not None:
        print(f"selection: {gpu_rules}")
    print(flush=True)

    platform = device_platform(devices[0])
    tiers = tiers_for(args.weight_layout, config, platform=platform)
    for reason in untimed_tiers(config, args.weight_layout, platform):
        print(f"not run: {reason}")
    progress("placing the weights on the mesh")
    norm_weight, up_proj_kernel = place_weights(config, mesh, args.weight_layout, rng, axis_name=AXIS_NAME)
    rows = []
    for index, num_tokens in enumerate(args.tokens, start=1):
        routed_partials, shared_partials = place_partials(config, mesh, num_tokens, rng, axis_name=AXIS_NAME)
        forward = functools.partial(
            tail_forward, routed_partials, shared_partials, norm_weight, up_proj_kernel,
            config=config, mesh=mesh, axis_name=AXIS_NAME, weight_layout=args.weight_layout,
        )
        selection = mesh_decision(config, num_tokens, mesh, args.weight_layout)
        selection = dataclasses.replace(selection, notes=tuple(note for note in selection.notes if note != gpu_rules))
        label = f"T={num_tokens} ({index}/{len(args.tokens)})"
        rows += run_every_tier(forward, tiers, num_tokens, selection, args.repeats, label)

    print_table(rows)
    # `not <=` so that a NaN error fails too.
    tolerance = FP8_ACTIVATIONS_TOLERANCE if config.fp8_activations else RELATIVE_ERROR_TOLERANCE
    if config.all_reduce_quantization is not None:
        # Each tier rounds its own sums (about a third of a codec step each, RMS, at different points),
        # so two tiers may differ by that twice over: two steps leave room.
        tolerance += 2 * CODECS[config.all_reduce_quantization].relative_step
    failures = [row for row in rows if not row.relative_error <= tolerance]
    print()
    if not failures:
        print(f"every tier agrees with native: relative error <= {tolerance:g} for every T")
        return 0
    for row in failures:
        print(
            f"FAIL: T={row.num_tokens} {row.tier.value}: relative error {row.relative_error:.3e} "
            f"vs native exceeds {tolerance:g}"
        )
    return 1


@dataclasses.dataclass(frozen=True)
class TierRow:
    """One row of the demo's table: one tier at one token count, compared with the native tier."""

    num_tokens: int
    tier: Tier
    selection: TierDecision
    max_abs_error: float
    relative_error: float
    timing: Timing


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
        output, warmup_seconds, timing = time_runs(functools.partial(forward, tier=tier), repeats=repeats)
        timings[tier] = np.asarray(output, dtype=np.float32), timing
        progress(f"warm-up {warmup_seconds:.2f} s, median {1e3 * timing.median_s:.1f} ms")
    native_output, _ = timings[Tier.NATIVE]
    native_norm = np.linalg.norm(native_output)
    rows = []
    for tier, (output, timing) in timings.items():
        difference = output - native_output
        rows.append(TierRow(
            num_tokens, tier, selection,
            max_abs_error=float(np.max(np.abs(difference))),
            relative_error=float(np.linalg.norm(difference) / native_norm),
            timing=timing,
        ))
    return rows


def print_table(rows: Sequence[TierRow]) -> None:
    """The demo's table, one block of rows per token count; the selected tier's row gives the reason,
    and a line after each block says how far the selection is from the fastest tier."""
    print(f"{'T':>5}  {'tier':<16}{'max abs err':>12}{'rel err':>11}{'median ms':>11}{'vs fastest':>12}"
          "  selected because")
    blocks: dict[int, list[TierRow]] = {}
    for row in rows:
        blocks.setdefault(row.num_tokens, []).append(row)
    for index, (num_tokens, block) in enumerate(blocks.items()):
        if index:
            print()
        timings = {row.tier: row.timing for row in block}
        fastest = min(timings.values(), key=lambda timing: timing.median_s)
        selection = block[0].selection
        for row in block:
            if row.tier == Tier.NATIVE:
                errors = f"{'reference':>12}{'':>11}"
            else:
                errors = f"{row.max_abs_error:>12.3e}{row.relative_error:>11.3e}"
            reason = f"  <- {selection.reason}" if selection.tier == row.tier else ""
            print(f"{row.num_tokens:>5}  {row.tier.value:<16}{errors}{1e3 * row.timing.median_s:>11.1f}"
                  f"{format_vs_fastest(row.timing, fastest):>12}{reason}")
        print(f"{'':>7}T={num_tokens}: {format_selection_gap(selection.tier, timings)}")
