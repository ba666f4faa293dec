"""The per-rank entry point: the tail as one TP rank computes it, inside the caller's ``jax.shard_map``.
Notation (T, L, H, p): docs/design.md, "Conventions"."""

from __future__ import annotations

import jax
import numpy as np

from k3_tail._checks import AxisName, axis_size_in_scope, check_axis_name, expect_array, expect_rank, variation_over
from k3_tail.config import TailConfig, check_config
from k3_tail.hardware import check_device, device_platform
from k3_tail.ops.columns import check_weight_layout, column_block_width
from k3_tail.ops.tokens import pad_tokens, padded_token_count
from k3_tail.ops.up_projection import QuantizedKernel, check_fp8_activations, check_up_proj_kernel
from k3_tail.selection.lowering import TailBranch, per_lowering_platform, tail_branches
from k3_tail.selection.rules import choose_tier
from k3_tail.tiers.context import TailCall
from k3_tail.tiers.registry import Tier


def latent_moe_tail(
    routed_partial: jax.Array,
    shared_partial: jax.Array | None,
    norm_weight: jax.Array | None,
    up_proj_kernel: jax.Array | QuantizedKernel,
    *,
    config: TailConfig,
    axis_name: AxisName = "tp",
    weight_layout: str = "replicated",
    tier: Tier | str | None = None,
    device: jax.Device | None = None,
    rank: jax.Array | None = None,
) -> jax.Array:
    """``y = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i`` for this TP rank, inside ``jax.shard_map`` over ``axis_name``.

    Never modifies its inputs; costs are the tier's. Composes with jit, vmap, scan, remat, grad/vjp/jvp (not
    with quantised sums) and ``jax.export``.

    Args:
      routed_partial: [T, L] in ``config.dtype``, this rank's routed partial (the reduced latent with
        ``config.routed_output_is_reduced``).
      shared_partial: [T, H], this rank's shared partial (with ``config.shared_output_is_reduced`` what
        :func:`k3_tail.reduce_shared` returns); None exactly without ``config.has_shared_experts``.
      norm_weight: [L] RMSNorm scale g; None exactly without ``config.use_latent_norm``.
      up_proj_kernel: [L, H] ("replicated"), or this rank's [L, Hb] block of the kernel padded to
        ``padded_hidden_size(H, p)`` columns ("column", in_spec ``P(None, axis_name)``); a
        :class:`k3_tail.QuantizedKernel` with an FP8 ``config.up_proj_dtype``.
      config, axis_name, weight_layout: the TailConfig; the TP axis (names whose sizes multiply to p); the layout.
      tier: a :class:`k3_tail.Tier` (or its value) to force, or None: :func:`k3_tail.select_tier`'s.
      device: a device of the mesh, whose platform and kind selection and the FP8 check read; None: one program
        per lowering platform, joined by ``jax.lax.platform_dependent``.
      rank: this rank's index, int32 [1] (its block of ``jnp.arange(p, dtype=jnp.int32)``, in_spec
        ``P(axis_name)``); None: ``lax.axis_index`` (on a GPU one_kernel then launches one more kernel).

    Returns:
      y [T, H] in ``config.dtype``, the same on every rank (out_spec ``P()``); with ``config.sequence_parallel``
      this rank's [T'/p, H] rows of y zero-padded to T' = ``padded_token_count(T, p)`` (``P(axis_name)``).

    Raises:
      ValueError: naming the argument, before any work: bad shapes or dtypes, no TP axis in scope, a forced tier
        that cannot run, FP8 activations ``device`` does not multiply, or (where the shard_map types values) an
        input whose variation over the axis contradicts its config field, or a ``rank`` the same on every rank.
    """
    check_config(config)
    axis_name = check_axis_name(axis_name)
    weight_layout = check_weight_layout(weight_layout)
    tp_size = axis_size_in_scope(axis_name, "latent_moe_tail")
    num_tokens = _check_per_rank_inputs(
        routed_partial, shared_partial, norm_weight, up_proj_kernel,
        config=config, tp_size=tp_size, weight_layout=weight_layout,
    )
    if tier is not None:
        tier = Tier.parse(tier)
        tier.record.check_runs(weight_layout, config)
    device = check_device(device, optional=True)
    if device is not None:
        check_fp8_activations(config.up_proj_dtype, config.fp8_activations, device)
    if rank is not None:
        _check_rank(rank, axis_name, tp_size)
    variation = variation_over(axis_name, {"routed_partial": routed_partial, "shared_partial": shared_partial,
                                           "rank": rank})
    if variation is not None:
        _check_variation(variation, config=config, axis_name=axis_name)

    return run_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, config=config, axis_name=axis_name,
                    tp_size=tp_size, num_tokens=num_tokens, weight_layout=weight_layout, tier=tier,
                    platform=None if device is None else device_platform(device),
                    device_kind=None if device is None else device.device_kind, rank=rank)


def run_tail(routed_partial, shared_partial, norm_weight, up_proj_kernel, *, config: TailConfig, axis_name: AxisName,
             tp_size: int, num_tokens: int, weight_layout: str, tier: Tier | None, platform: str | None,
             device_kind: str | None, rank: jax.Array | None) -> jax.Array:
    """:func:`latent_moe_tail` on checked arguments (by it, or globally by :func:`k3_tail.tail_forward`), the device
    as its ``platform`` (None: the lowering platform's) and kind."""
    if config.sequence_parallel:
        # Zero token rows up to a multiple of p: JAX shards evenly only (a reduced shared output already is this
        # rank's rows).
        routed_partial = pad_tokens(routed_partial, tp_size)
        if shared_partial is not None and not config.shared_output_is_reduced:
            shared_partial = pad_tokens(shared_partial, tp_size)

    def run(branch: TailBranch, routed_partial, shared_partial, norm_weight, up_proj_kernel, rank):
        call = TailCall.inside_shard_map(config, axis_name=axis_name, weight_layout=weight_layout,
                                         platform=branch.platform, rank=rank)
        return branch.tier.record.function(routed_partial, shared_partial, norm_weight, up_proj_kernel, call)

    operands = (routed_partial, shared_partial, norm_weight, up_proj_kernel, rank)
    if platform is not None:  # the device's platform: one program
        chosen = tier or choose_tier(config, num_tokens, tp_size, weight_layout=weight_layout,
                                     device_kind=device_kind, platform=platform).tier
        return run(TailBranch(chosen, platform), *operands)
    # Else one branch per distinct program of the platforms the call may be lowered for.
    branches = tail_branches(config, num_tokens, tp_size, weight_layout=weight_layout, tier=tier)
    return per_lowering_platform(branches, run, *operands)


def _check_rank(rank, axis_name: AxisName, tp_size: int) -> None:
    """ValueError naming ``rank`` unless it is an int32 [1] in [0, p) where known (a traced one outside gives NaN)."""
    expect_array(rank, "rank", [(1,)], np.dtype(np.int32), "this rank's index: its block of jnp.arange(p)",
                 dtype_field="int32")
    if not isinstance(rank, jax.core.Tracer) and not 0 <= int(np.asarray(rank)[0]) < tp_size:
        raise ValueError(f"rank: expected this rank's index in [0, {tp_size}) along {axis_name!r}, got "
                         f"{int(np.asarray(rank)[0])}")


def _check_variation(variation: dict[str, bool], *, config: TailConfig, axis_name: AxisName) -> None:
    """ValueError naming the argument or the config field it contradicts where an input's variation over the TP
    axis is not what the call expects (a partial and ``rank`` vary, a reduced output does not)."""
    if variation.get("rank") is False:
        raise ValueError(f"rank: expected this rank's index, which varies over {axis_name!r} (the block of "
                         f"jnp.arange(p, dtype=jnp.int32) with in_spec P({axis_name!r})), but its type is the same "
                         "on every rank")
    contract = [("routed_partial", "routed_output_is_reduced", "the reduced latent")]
    # A reduced shared output in the token-sharded form is this rank's rows of the sum: it varies too.
    if not (config.shared_output_is_reduced and config.sequence_parallel):
        contract.append(("shared_partial", "shared_output_is_reduced", "the output of k3_tail.reduce_shared"))
    for name, field, reduced_form in contract:
        reduced = getattr(config, field)
        if variation.get(name, reduced) != reduced:  # absent (None): nothing to check
            continue
        if reduced:
            raise ValueError(
                f"{name}: config.{field} is True, so expected {reduced_form}, the same on every rank, but its "
                f"type varies over {axis_name!r}: a per-rank partial (the tail would not sum it). Pass the "
                f"reduced value, or set TailConfig({field}=False) for partials"
            )
        raise ValueError(
            f"{name}: config.{field} is False, so expected this rank's partial, which varies over {axis_name!r}, "
            f"but its type is the same on every rank: a reduced value (the tail would add it p times). Pass "
            f"the partial, or set TailConfig({field}=True) for {reduced_form}"
        )


def _check_per_rank_inputs(routed_partial, shared_partial, norm_weight, up_proj_kernel, *, config, tp_size,
                           weight_layout) -> int:
    hidden, latent = config.hidden_size, config.latent_size
    expect_rank(routed_partial, "routed_partial", "[T, L] (this rank's block)", 2)
    num_tokens = routed_partial.shape[0]
    expect_array(routed_partial, "routed_partial", [(num_tokens, latent)], config.dtype, f"L={latent}")
    shared_rows, shared_sizes = num_tokens, f"T={num_tokens}, H={hidden}"
    if config.shared_output_is_reduced and config.sequence_parallel:
        shared_rows = padded_token_count(num_tokens, tp_size) // tp_size
        shared_sizes = (f"the reduced shared output's rows of this rank: T'/p = {shared_rows} for T={num_tokens}, "
                        f"p={tp_size}, as k3_tail.reduce_shared returns them; H={hidden}")
    elif config.shared_output_is_reduced:
        shared_sizes = f"the reduced shared output, as k3_tail.reduce_shared returns it: T={num_tokens}, H={hidden}"
    expect_array(shared_partial, "shared_partial", [(shared_rows, hidden)], config.dtype, shared_sizes,
                 none_because=None if config.has_shared_experts else "config.has_shared_experts is False")
    expect_array(norm_weight, "norm_weight", [(latent,)], config.dtype, f"L={latent}",
                 none_because=None if config.use_latent_norm else "config.use_latent_norm is False")
    if weight_layout == "column":
        block = column_block_width(hidden, tp_size)
        shapes, sizes = [(latent, block)], f"this rank's column block: L={latent}, ceil(H/p) = ceil({hidden}/{tp_size})"
    else:
        shapes, sizes = [(latent, hidden)], f"L={latent}, H={hidden}"
    check_up_proj_kernel(up_proj_kernel, dtype=config.dtype, up_proj_dtype=config.up_proj_dtype, shapes=shapes,
                         sizes=sizes, column_block=weight_layout == "column")
    return num_tokens
