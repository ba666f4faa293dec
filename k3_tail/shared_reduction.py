"""The shared experts' reduction, per rank, issued as early as the model likes: it can then travel while the
routed experts compute (vLLM's VLLM_KIMI_K3_SHARED_OUTPUT_AR_OVERLAP)."""

from __future__ import annotations

import jax

from k3_tail._checks import AxisName, axis_size_in_scope, check_axis_name, expect_array, expect_rank
from k3_tail.config import TailConfig, check_config
from k3_tail.hardware import check_device, device_platform
from k3_tail.ops.scopes import SHARED_REDUCTION
from k3_tail.ops.tokens import pad_tokens
from k3_tail.selection.lowering import LOWERING_PLATFORMS, per_lowering_platform
from k3_tail.tiers.context import TailCall


def reduce_shared(
    shared_partial: jax.Array,
    *,
    config: TailConfig,
    axis_name: AxisName = "tp",
    device: jax.Device | None = None,
) -> jax.Array:
    """The sum over the TP ranks of the shared-expert partials, in the form the tail takes it as ``shared_partial``
    with ``TailConfig(shared_output_is_reduced=True)``; call it inside the ``jax.shard_map`` as soon as the shared
    experts finish.

    Args:
      shared_partial: this rank's [T, H] partial in ``config.dtype``.
      config, axis_name: as for :func:`k3_tail.latent_moe_tail`.
      device: a device of the mesh, whose platform decides the all-reduce's form; None: the lowering platform's.

    Returns:
      The sum [T, H], the same on every rank (an all-reduce); with ``config.sequence_parallel`` this rank's
      [T'/p, H] rows of it zero-padded to T' = ``padded_token_count(T, p)`` (a reduce-scatter over tokens).

    Raises:
      ValueError: naming the argument, for a wrong shape or dtype, a config without shared experts or without
        ``shared_output_is_reduced``, no ``axis_name`` in scope, or a ``device`` that is no ``jax.Device``.
    """
    check_config(config)
    axis_name = check_axis_name(axis_name)
    tp_size = axis_size_in_scope(axis_name, "reduce_shared")
    if not config.has_shared_experts:
        raise ValueError("config: has_shared_experts is False, so there is no shared output to reduce")
    if not config.shared_output_is_reduced:
        raise ValueError("config: shared_output_is_reduced is False, so the tail takes the shared partials and "
                         "sums them itself (a reduced shared output would be added p times); use "
                         "TailConfig(shared_output_is_reduced=True) for the tail that takes this function's result")
    expect_rank(shared_partial, "shared_partial", "[T, H] (this rank's shared-expert partial)", 2)
    hidden = config.hidden_size
    expect_array(shared_partial, "shared_partial", [(shared_partial.shape[0], hidden)], config.dtype, f"H={hidden}")
    device = check_device(device, optional=True)
    if config.sequence_parallel:
        shared_partial = pad_tokens(shared_partial, tp_size)
    nbytes = shared_partial.size * shared_partial.dtype.itemsize

    def form_on(platform: str) -> str:
        return config.sum_plan(tp_size, platform).form_for(config.dtype, nbytes)

    # The device's platform where given, else the lowering's; platforms whose sum travels alike share a branch.
    branches = {platform: device_platform(device) if device is not None else
                next(other for other in LOWERING_PLATFORMS if form_on(other) == form_on(platform))
                for platform in LOWERING_PLATFORMS}

    def run(platform: str, shared_partial):
        # The layout is not read: the sum involves no kernel.
        call = TailCall.inside_shard_map(config, axis_name=axis_name, weight_layout="replicated", platform=platform)
        return call.reduce_output(shared_partial, scope=SHARED_REDUCTION)

    return per_lowering_platform(branches, run, shared_partial)
