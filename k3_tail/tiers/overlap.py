"""The overlap tier (vLLM tier 1): the shared all-reduce in flight while the up projection runs.

How the overlap is made to happen on GPU backends (CUDA and ROCm share XLA's GPU scheduler):
left alone, XLA's all-reduce combiner merges the latent and the shared all-reduce, which are
independent, into ONE synchronous all-reduce before the GEMM, and nothing overlaps.
Two devices act against that:

1. In the program: the shared partial passes through ``lax.optimization_barrier`` together with the
   normalised latent, so the shared all-reduce is ordered after the latent one and a program that
   is just the tail (``jax.jit(tail_forward)``, no options) compiles with the shared all-reduce as
   an async start/done pair around the GEMM. With the column layout a second barrier holds the
   output all-gather until the shared all-reduce is done, so the GEMM is the work left to hide it.
   The barriers order values only; they emit no kernel.
2. Per executable: in a larger program (measured: two chained tails in one ``jit``) XLA still
   combines the all-reduces of different tails and layers. :func:`k3_tail.xla.compilation.compiler_options` gives
   the options for such an executable: ``xla_gpu_all_reduce_combine_threshold_bytes=0`` (no
   all-reduce combining in that executable, which is the price), async collectives pinned on and
   the latency-hiding scheduler on (XLA's default for CUDA, not for ROCm before jax 0.12);
   likewise no all-gather combining, for a quantised shared sum (:mod:`k3_tail.ops.collectives`),
   whose second shot, an all-gather, would otherwise join the latent's before the GEMM.
   :func:`k3_tail.compile_tail` applies them to the tail's own executable.

``k3_tail.xla.report`` checks the result on the compiled program; the tests check it for a
deviceless 8-GPU topology at T in {1, 16, 256}, for both kernel layouts.

Summary: vLLM tier 1: the shared all-reduce in flight while the up projection runs
Schedule: AR(r) + norm; AR(s) started; GEMM; AR(s) done; add
Collectives: AR(TL), AR(TH) beside the GEMM (column layout: + AG(TH) of the output blocks)
Token-sharded output: AR(s) becomes a reduce-scatter over tokens and each rank keeps its rows of the projection
Shared output reduced: nothing is left to overlap: the reduced shared output is added, as native does
"""

from __future__ import annotations

from types import MappingProxyType

import jax
from jax import lax

from k3_tail.ops.columns import gather_columns, project_own_columns
from k3_tail.ops.tokens import own_tokens
from k3_tail.tiers.context import TailCall
from k3_tail.tiers.record import CallShape, CollectiveTerm, GpuKernelCounts, TierRecord


def overlap_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, call: TailCall) -> jax.Array:
    """AR(r) + norm; AR(s) issued; GEMM while AR(s) is in flight; add (a
    :class:`~k3_tail.tiers.context.TierFunction`).

    Cost per rank: as the native tier's, but AR(T*H) runs during the GEMM instead of after it (the
    module docstring says how). With ``shared_output_is_reduced`` there is no AR(s) to hide, and the
    schedule is the native tier's.
    """
    config = call.config
    latent = call.normalised_latent(routed_partial, norm_weight)
    projected = project_own_columns(latent, up_proj_kernel, weight_layout=call.weight_layout,
                                    fp8_activations=config.fp8_activations)
    shared = None
    if shared_partial is not None and config.shared_output_is_reduced:
        shared = shared_partial  # reduced before the tail: nothing is left to overlap
    elif shared_partial is not None:
        # The shared partial waits for the normalised latent, so the two all-reduces cannot be combined.
        _, shared_partial = lax.optimization_barrier((latent, shared_partial))
        shared = call.shared_output(shared_partial)
        # The column layout's all-gather waits for the shared all-reduce, which leaves the GEMM as the
        # only work to schedule inside it (else XLA may run the GEMM first and hide the all-gather).
        _, projected = lax.optimization_barrier((shared, projected))
    projected = gather_columns(projected, hidden_size=config.hidden_size, weight_layout=call.weight_layout,
                               axis_name=call.axis_name)
    if call.token_sharded:
        projected = own_tokens(projected, axis_name=call.axis_name)
    return call.add_shared(projected, shared)


def _collectives(shape: CallShape) -> tuple[CollectiveTerm, ...]:
    shared = ()
    if shape.sums_shared:
        shared = (CollectiveTerm(shape.output_reduction, shape.rows * shape.hidden_size, beside_gemm=True),)
    return shape.latent_reduction() + shared + shape.column_gather()


RECORD = TierRecord(
    name="overlap",
    function=overlap_tail,
    projects_all_columns=True,
    collectives=_collectives,
    gpu_kernels=GpuKernelCounts.measured(cuda={"column": (7, 5), "replicated": (7, 4)},
                                  rocm={"column": (7, 5), "replicated": (6, 4)}),
    # In a program with more than one tail the all-reduce combiner would merge the shared all-reduce
    # with others (nothing would overlap), and a synchronous all-reduce hides behind nothing.
    # A quantised sum's second shot is an all-gather, which XLA would combine with the latent's (before
    # the GEMM) for the same reason. The latency-hiding scheduler is what moves the GEMM inside the pair:
    # XLA turns it on by itself for CUDA, and for ROCm only from jax 0.12 on (measured: without it, jax
    # 0.10.2's MI300X and MI355X programs put no GEMM inside the async all-reduce or all-gather).
    compiler_options=MappingProxyType({"gpu": MappingProxyType({
        "xla_gpu_all_reduce_combine_threshold_bytes": 0, "xla_gpu_all_gather_combine_threshold_bytes": 0,
        "xla_gpu_disable_async_collectives": "", "xla_gpu_enable_latency_hiding_scheduler": True,
    })}),
)
