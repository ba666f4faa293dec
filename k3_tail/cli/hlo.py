"""``k3-tail hlo``: the XLA report of one compiled tail call.

Compiles one tail call (Kimi-K3 shapes) for a deviceless GPU topology (``h100x8``, ...), a CPU
mesh or this machine's accelerators, and prints :mod:`k3_tail.xla.report`'s report: per-device
cost, every collective, and whether the shared reduction overlaps the GEMM; ``--json`` prints it
as JSON. The tier is the one :func:`k3_tail.select_tier` picks for ``--tokens`` unless ``--tier``
forces one; a tier that cannot run with the kernel layout is a one-line error (exit status 2).
"""

from __future__ import annotations

import argparse
import json

import jax
from jax.sharding import Mesh

from k3_tail.cli.common import (
    AXIS_NAME, DEFAULT_CPU_DEVICES, MAX_CPU_DEVICES, CommandError, add_all_reduce_quantization_arguments,
    add_reduced_shared_argument, add_up_projection_arguments, add_weight_layout_argument,
    all_reduce_quantization_options, cpu_device_count, demo_devices, describe_config, mesh_decision,
    non_negative_int, tp_mesh, up_projection_options,
)
from k3_tail.config import TailConfig
from k3_tail.tiers.registry import Tier
from k3_tail.xla import report as xla_report
from k3_tail.xla.compilation import compile_tail, compiler_options
from k3_tail.xla.topologies import TopologyUnavailable, topology_mesh

DEFAULT_HLO_TOKENS = 16
DEFAULT_TOPOLOGY = "h100x8"


def add_parser(commands: argparse._SubParsersAction) -> None:
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
        "--devices", type=cpu_device_count, default=DEFAULT_CPU_DEVICES, metavar="N",
        help=f"CPU devices for --topology cpu, at most {MAX_CPU_DEVICES} (default: {DEFAULT_CPU_DEVICES})",
    )
    add_weight_layout_argument(hlo)
    add_up_projection_arguments(hlo)
    add_reduced_shared_argument(hlo)
    add_all_reduce_quantization_arguments(hlo)
    hlo.add_argument("--json", action="store_true", help="print the report as JSON")
    hlo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """The ``hlo`` command: compile, report, print (text or JSON)."""
    mesh = hlo_mesh(args.topology, args.devices)
    try:
        config = TailConfig.kimi_k3(shared_output_is_reduced=args.reduced_shared, **up_projection_options(args),
                                    **all_reduce_quantization_options(args))
    except ValueError as error:
        raise CommandError(f"config: {error}") from None
    tp_size = mesh.shape[AXIS_NAME]
    selection = mesh_decision(config, args.tokens, mesh, args.weight_layout)
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
            "up_proj_dtype": args.up_proj_dtype, "fp8_activations": args.fp8_activations,
            "shared_output_is_reduced": args.reduced_shared,
            "all_reduce_quantization": config.all_reduce_quantization,
            "quantized_all_reduce_min_bytes": config.quantized_all_reduce_min_bytes, "report": report.to_dict(),
        }, indent=2))
        return 0
    print(f"tier: {tier.value} ({why}); T={args.tokens}, p={tp_size}, kernel layout {args.weight_layout}")
    print(f"config: Kimi-K3 tail, {describe_config(config)}")
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
    return tp_mesh(devices)
