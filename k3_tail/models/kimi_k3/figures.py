"""The Kimi-K3 layer's compiled figures per rank: temp memory, bytes accessed, GPU kernels, the largest writes.

    python -m k3_tail.models.kimi_k3.figures [--topology cpu|h100x8|mi300xx8|mi355xx8] [--tokens 1,2048]

prints, per T, the layer with MXFP4 and with bf16 routed experts compiled as :func:`compile_layer` compiles it.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import jax

import k3_tail
from k3_tail.models.kimi_k3.layer import compile_layer
from k3_tail.models.kimi_k3.layer_config import (
    KIMI_K3_EXPERT_INTERMEDIATE_SIZE,
    KIMI_K3_NUM_EXPERTS,
    KIMI_K3_TOP_K,
    LayerConfig,
)
from k3_tail.models.kimi_k3.mxfp4 import MXFP4_BYTES
from k3_tail.models.kimi_k3.mxfp4_experts import (
    ACTIVATION_FORMATS,
    activation_quantization_error,
    expert_bytes_per_rank,
    mxfp4_path,
)
from k3_tail.models.kimi_k3.routed_experts import routed_expert_method
from k3_tail.xla import hlo_text, report as xla_report


@dataclasses.dataclass(frozen=True)
class CompiledFigures:
    """Per rank, one compiled layer: XLA's temp bytes, bytes accessed, GPU kernels (None for a CPU program) and the
    elements of the largest floating-point and byte arrays it writes (a decoded or copied expert would be those)."""

    temp_bytes: int
    bytes_accessed: float
    kernels: int | None
    largest_float_write: int
    largest_byte_write: int


def compiled_figures(quantization: str | None, mesh, num_tokens: int) -> CompiledFigures:
    """The Kimi-K3 layer (896 experts, top 16) with routed experts held as ``quantization`` (None: bf16), compiled
    for T tokens on ``mesh`` by ``compile_layer``, with XLA's dump in a temporary directory."""
    config = LayerConfig.kimi_k3(num_experts=KIMI_K3_NUM_EXPERTS, top_k=KIMI_K3_TOP_K,
                                 expert_quantization=quantization)
    with tempfile.TemporaryDirectory() as dump_dir:
        compiled = compile_layer(config, mesh, num_tokens, xla_options={"xla_dump_to": dump_dir})
        return figures_of(compiled, dump_dir)


def figures_of(compiled: jax.stages.Compiled, dump_dir: str) -> CompiledFigures:
    """:class:`CompiledFigures` of a compiled layer whose XLA dump is in ``dump_dir``."""
    figures = xla_report.report(compiled, shared_argument=None, dump_dir=dump_dir)
    module = hlo_text.parse_module(compiled.as_text())
    largest = [hlo_text.largest_write(module, dtypes) for dtypes in (hlo_text.FLOAT_DTYPES, hlo_text.BYTE_DTYPES)]
    return CompiledFigures(compiled.memory_analysis().temp_size_in_bytes, figures.bytes_accessed,
                           figures.gpu_kernel_count, *(0 if array is None else array.elements for array in largest))


def main(argv: list[str] | None = None) -> int:
    """Per rank, one Kimi-K3 MoE layer (896 experts, top 16) at p = 8: the routed experts' bytes from the
    shapes, and the layer compiled with MXFP4 and with bf16 experts: per T the path the MXFP4 experts take and
    the three figures (temp bytes, bytes accessed, kernels) of each."""
    from k3_tail.cli.harness import positive_int_list  # the harness's types, loaded for the command only

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--topology", default="cpu", help="cpu (8 CPU devices) or a deviceless GPU topology "
                        "of k3_tail.topology_mesh, e.g. h100x8 (default: cpu)")
    parser.add_argument("--tokens", type=positive_int_list, default=(1, 2048), metavar="T,T,...",
                        help="token counts, comma-separated (default: 1,2048)")
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # compiles only: a deviceless topology needs no GPU backend
    jax.config.update("jax_num_cpu_devices", 8)
    try:
        mesh = (jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8]) if args.topology == "cpu"
                else k3_tail.topology_mesh(args.topology))
    except (ValueError, k3_tail.TopologyUnavailable) as error:
        parser.error(f"--topology: {error}")
    tp_size, experts = mesh.shape["tp"], KIMI_K3_NUM_EXPERTS
    for name, per_weight in (("mxfp4", MXFP4_BYTES), ("bfloat16", 2)):
        held = expert_bytes_per_rank(experts, 3584, KIMI_K3_EXPERT_INTERMEDIATE_SIZE, tp_size, per_weight)
        print(f"routed experts held as {name}: {held:,} bytes per rank ({per_weight:g} bytes per weight)")
    device = mesh.devices.flat[0]
    print(f"why no other route on {device.device_kind}: {mxfp4_path('gather', device, tp_size=tp_size).reason}")
    print("activations' relative error in one expert's 3584-deep product: "
          + ", ".join(f"{name or 'bf16 (the layer)'} {activation_quantization_error(name):.2%}"
                      for name in (None, *ACTIVATION_FORMATS)))
    print(f"compiled for {args.topology} (p = {tp_size}, jax {jax.__version__}), per rank, MXFP4 experts / bf16:")
    config = LayerConfig.kimi_k3(num_experts=experts, top_k=KIMI_K3_TOP_K)
    for num_tokens in args.tokens:
        method = routed_expert_method(config, num_tokens).method
        mxfp4, bf16 = (compiled_figures(quantization, mesh, num_tokens) for quantization in ("mxfp4", None))
        kernels = "" if mxfp4.kernels is None else f", kernels {mxfp4.kernels} / {bf16.kernels}"
        print(f"  T = {num_tokens:5}: {method}, {mxfp4_path(method, device, tp_size=tp_size).decode}\n"
              f"            temp {mxfp4.temp_bytes:,} / {bf16.temp_bytes:,} bytes, accessed "
              f"{mxfp4.bytes_accessed:,.0f} / {bf16.bytes_accessed:,.0f} bytes{kernels}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
