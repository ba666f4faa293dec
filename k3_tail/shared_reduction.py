"""The shared experts' reduction, per rank, issued as early as the model likes.

The shared-expert partials do not depend on the routed experts, so their sum can travel while the
routed experts compute (tens of microseconds at decode on a GPU) instead of beside the tail's up
projection (one or two): vLLM's VLLM_KIMI_K3_SHARED_OUTPUT_AR_OVERLAP.
"""

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
    """The sum over the TP ranks of the shared-expert partials, in the form the tail takes it.

    Call it inside a ``jax.shard_map`` whose mesh has the TP axis ``axis_name``, as soon as the
    shared experts finish, and pass the result as ``shared_partial`` of
    :func:`k3_tail.latent_moe_tail` (or :meth:`k3_tail.LatentMoETail.per_rank`) with
    ``TailConfig(shared_output_is_reduced=True)``. The collective carries the named scope
    ``k3_tail/shared_reduction``.

    Args:
      shared_partial: this rank's [T, H] partial, dtype ``config.dtype``.
      config: the tail's :class:`k3_tail.TailConfig`, with shared experts and
        ``shared_output_is_reduced``.
      axis_name: the TP axis: a name, or a tuple of names as for :func:`k3_tail.latent_moe_tail`.
      device: a device of the mesh, whose platform then decides the all-reduce's form; None: the platform
        the program is lowered for decides (``jax.lax.platform_dependent``), as in :func:`k3_tail.latent_moe_tail`.

    Returns:
      In ``config.dtype``: without ``config.sequence_parallel`` the sum [T, H], the same on every
      rank (an all-reduce in the form ``config.all_reduce_form`` picks); with it this rank's rows of
      the sum, [T'/p, H], T' = ``padded_token_count(T, p)`` (zero rows appended): a reduce-scatter
      over tokens, half the wire bytes, in the rows the tail's token-sharded output then has.

    Raises:
      ValueError: naming the argument, for a wrong shape or dtype, a config without shared experts or
        without ``shared_output_is_reduced`` (the tail it feeds must take a reduced shared output),
        no ``axis_name`` axis in scope, or a ``device`` that is no ``jax.Device``
        (:func:`k3_tail.hardware.check_device`).
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

    # As latent_moe_tail's sums: the device's platform where given, else the lowering's; platforms whose sum
    # travels alike share one branch (their first).
    branches = {platform: device_platform(device) if device is not None else
                next(other for other in LOWERING_PLATFORMS if form_on(other) == form_on(platform))
                for platform in LOWERING_PLATFORMS}

    def run(platform: str, shared_partial):
        # The layout is not read: the sum involves no kernel.
        call = TailCall.inside_shard_map(config, axis_name=axis_name, weight_layout="replicated", platform=platform)
        return call.reduce_output(shared_partial, scope=SHARED_REDUCTION)

    return per_lowering_platform(branches, run, shared_partial)
