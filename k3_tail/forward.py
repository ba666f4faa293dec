"""The global-array entry point: validate, place on the mesh, and run :func:`latent_moe_tail` per rank."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail._checks import AxisName, check_axis_name, check_mesh, expect_array, expect_rank
from k3_tail.config import TailConfig, check_config
from k3_tail.hardware import device_platform
from k3_tail.ops.columns import check_weight_layout, pad_columns, padded_hidden_size
from k3_tail.ops.tokens import pad_tokens
from k3_tail.ops.up_projection import check_fp8_activations, check_up_proj_kernel, column_sharding, column_spec
from k3_tail.per_rank import run_tail
from k3_tail.selection.rules import choose_tier
from k3_tail.tiers.context import is_token_sharded_output
from k3_tail.tiers.registry import Tier


def tail_forward(
    routed_partials,
    shared_partials,
    norm_weight,
    up_proj_kernel,
    *,
    config: TailConfig,
    mesh: Mesh,
    axis_name: AxisName = "tp",
    tier: Tier | str | None = None,
    weight_layout: str = "replicated",
) -> jax.Array:
    """``y = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i`` on ``mesh``, each rank running
    :func:`k3_tail.latent_moe_tail` on its blocks. Eager (compiled once per shape and placement) or under
    ``jax.jit``; never modifies or donates its inputs.

    Args:
      routed_partials: [p, T, L], entry i rank i's routed partial ([T, L], the reduced latent, with
        ``config.routed_output_is_reduced``): numpy or jax arrays of ``config.dtype`` in any sharding.
      shared_partials: [p, T, H], or the reduced [T, H] with ``config.shared_output_is_reduced``; None exactly
        without ``config.has_shared_experts``.
      norm_weight: [L] RMSNorm scale g; None exactly without ``config.use_latent_norm``.
      up_proj_kernel: [L, H] (y = x @ W), for "column" also padded to [L, padded_hidden_size(H, p)]; a
        :class:`k3_tail.QuantizedKernel` with an FP8 ``config.up_proj_dtype``.
      config, mesh, axis_name: the :class:`TailConfig`; a Mesh whose TP axis (a name, or names whose sizes
        multiply to p) is ``axis_name``, its other axes replicating the computation.
      tier: a :class:`Tier` (or its value) to force, or None: :func:`select_tier`'s at trace time.
      weight_layout: "replicated" (the whole kernel on every rank) or "column" (``P(None, axis_name)``).

    Returns:
      y [T, H] in ``config.dtype``, replicated ([0, H] for T = 0). With ``config.sequence_parallel``: y padded
      to T' = ``padded_token_count(T, p)`` zero rows, [T', H], sharded over ``axis_name`` on its tokens; not
      sliced back, which would all-gather it (``jax.sharding.reshard(y, NamedSharding(mesh, P()))[:T]`` does).

    Raises:
      ValueError: naming the argument, for bad shapes or dtypes, a mesh without the axis or a wrong p.
    """
    check_config(config)
    axis_name = check_axis_name(axis_name)
    weight_layout = check_weight_layout(weight_layout)
    tp_size = check_mesh(mesh, axis_name)
    # Checked as given, before jit converts them: a float64 or a list is reported as what it is.
    num_tokens = _check_global_inputs(routed_partials, shared_partials, norm_weight, up_proj_kernel, config=config,
                                      tp_size=tp_size, weight_layout=weight_layout)
    resolved = resolved_tier(config, num_tokens, mesh, axis_name, tier, weight_layout)
    return _tail_forward_jit(routed_partials, shared_partials, norm_weight, up_proj_kernel,
                             *_per_rank_inputs(resolved, mesh, axis_name, abstract=False), config=config, mesh=mesh,
                             axis_name=axis_name, tier=resolved, weight_layout=weight_layout)


def lowered_tail(config: TailConfig, mesh: Mesh, arguments, *, axis_name: AxisName = "tp",
                 tier: Tier | str | None = None, weight_layout: str = "replicated") -> jax.stages.Lowered:
    """:func:`tail_forward`'s program lowered for abstract ``arguments`` (routed, shared, norm weight, kernel),
    followed by the per-rank inputs its tier reads: what :func:`k3_tail.compile_tail` compiles."""
    check_config(config)
    axis_name = check_axis_name(axis_name)
    weight_layout = check_weight_layout(weight_layout)
    num_tokens = arguments[0].shape[0 if config.routed_output_is_reduced else 1]
    resolved = resolved_tier(config, num_tokens, mesh, axis_name, tier, weight_layout)
    program = functools.partial(_tail_forward_jit, config=config, mesh=mesh, axis_name=axis_name, tier=resolved,
                                weight_layout=weight_layout)
    return jax.jit(program).lower(*arguments, *_per_rank_inputs(resolved, mesh, axis_name, abstract=True))


def resolved_tier(config, num_tokens, mesh, axis_name, tier, weight_layout) -> Tier:
    """The tier a call with T = ``num_tokens`` on ``mesh`` takes (``tier`` checked, or the selection's), made ready
    to lower (:meth:`~k3_tail.tiers.record.TierRecord.before_lowering`)."""
    device = mesh.devices.flat[0]
    if tier is None:
        resolved = _chosen_tier(config, num_tokens, check_mesh(mesh, axis_name), weight_layout, device)
    else:
        resolved = Tier.parse(tier)
        resolved.record.check_runs(weight_layout, config)
    check_fp8_activations(config.up_proj_dtype, config.fp8_activations, device)
    resolved.record.before_lowering(device_platform(device))
    return resolved


@functools.lru_cache(maxsize=1024)  # chosen once per call shape, as jit traces once: not in every call
def _chosen_tier(config: TailConfig, num_tokens: int, tp_size: int, weight_layout: str, device: jax.Device) -> Tier:
    return choose_tier(config, num_tokens, tp_size, weight_layout=weight_layout, device_kind=device.device_kind,
                       platform=device).tier


def _per_rank_inputs(tier: Tier, mesh: Mesh, axis_name: AxisName, *, abstract: bool) -> tuple:
    """The per-rank inputs ``tier`` reads, as arguments of the program (or their abstract values): the ranks'
    indices, which inside the program would cost a kernel that converts the partition id."""
    if not tier.record.reads_rank:
        return ()
    sharding = NamedSharding(mesh, P(axis_name))
    if abstract:
        return (jax.ShapeDtypeStruct((check_mesh(mesh, axis_name),), np.int32, sharding=sharding),)
    return (_placed_rank_indices(mesh, axis_name),)


@functools.cache  # placed once per mesh and axis, as jit caches its programs: no transfer in every call
def _placed_rank_indices(mesh: Mesh, axis_name: AxisName) -> jax.Array:
    """``arange(p, dtype=int32)`` placed ``P(axis_name)`` on ``mesh``, concrete even inside a caller's jit."""
    with jax.ensure_compile_time_eval():
        return jax.device_put(np.arange(check_mesh(mesh, axis_name), dtype=np.int32),
                              NamedSharding(mesh, P(axis_name)))


@functools.partial(jax.jit, static_argnames=("config", "mesh", "axis_name", "tier", "weight_layout"))
def _tail_forward_jit(routed_partials, shared_partials, norm_weight, up_proj_kernel, ranks=None, *, config, mesh,
                      axis_name, tier, weight_layout):
    tp_size = check_mesh(mesh, axis_name)
    num_tokens = routed_partials.shape[0 if config.routed_output_is_reduced else 1]
    if weight_layout == "column":
        up_proj_kernel = pad_columns(up_proj_kernel, padded_hidden_size(config.hidden_size, tp_size))

    routed_spec = P() if config.routed_output_is_reduced else P(axis_name)
    shared_spec = P(axis_name)
    if config.shared_output_is_reduced and config.sequence_parallel:
        # Each rank's tail takes its T'/p rows of the reduced shared output (k3_tail.reduce_shared's form).
        shared_partials = None if shared_partials is None else pad_tokens(shared_partials, tp_size)
    elif config.shared_output_is_reduced:
        shared_spec = P()
    columns = axis_name if weight_layout == "column" else None
    specs = (routed_spec, shared_spec, P())
    args = (
        *(None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
          for x, spec in zip((routed_partials, shared_partials, norm_weight), specs, strict=True)),
        jax.device_put(up_proj_kernel, column_sharding(up_proj_kernel, mesh, columns)),
    )
    args = (*args, ranks)
    specs = (*specs, column_spec(up_proj_kernel, columns), P(axis_name))
    device = mesh.devices.flat[0]
    platform = device_platform(device)
    # Checked as global arrays: each rank's blocks are what latent_moe_tail would check them to be.
    per_rank_tail = functools.partial(
        run_tail, config=config, axis_name=axis_name, tp_size=tp_size, num_tokens=num_tokens,
        weight_layout=weight_layout, tier=tier, platform=platform, device_kind=device.device_kind,
    )

    def per_rank(routed, shared, norm, kernel, rank):
        # The per-rank partials arrive as [1, T, X] blocks of the [p, T, X] globals.
        routed = routed if config.routed_output_is_reduced else routed[0]
        shared = shared if shared is None or config.shared_output_is_reduced else shared[0]
        return per_rank_tail(routed, shared, norm, kernel, rank=rank)

    in_specs = tuple(None if x is None else spec for x, spec in zip(args, specs, strict=True))
    out_spec = P(axis_name) if is_token_sharded_output(config, num_tokens, tp_size) else P()
    # Pallas's interpreter takes no values typed as varying over the mesh's axes: untyped where it runs.
    check_vma = not tier.record.runs_interpreted_on(platform)
    return jax.shard_map(per_rank, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)(*args)


def _check_global_inputs(routed_partials, shared_partials, norm_weight, up_proj_kernel, *, config, tp_size,
                         weight_layout) -> int:
    hidden, latent = config.hidden_size, config.latent_size
    routed_shape = np.shape(routed_partials)
    if config.routed_output_is_reduced:
        expect_rank(routed_partials, "routed_partials", "[T, L] (the reduced latent: routed_output_is_reduced)", 2)
        num_tokens = routed_shape[0]
        expected_routed = (num_tokens, latent)
    else:
        expect_rank(routed_partials, "routed_partials", "[p, T, L]", 3)
        num_tokens = routed_shape[1]
        expected_routed = (tp_size, num_tokens, latent)
    expect_array(routed_partials, "routed_partials", [expected_routed], config.dtype, f"p={tp_size}, L={latent}")

    shared_shape, shared_sizes = (tp_size, num_tokens, hidden), f"p={tp_size}, T={num_tokens}, H={hidden}"
    if config.shared_output_is_reduced:
        shared_shape = (num_tokens, hidden)
        shared_sizes = f"the reduced shared output (shared_output_is_reduced): T={num_tokens}, H={hidden}"
    expect_array(shared_partials, "shared_partials", [shared_shape], config.dtype, shared_sizes,
                 none_because=None if config.has_shared_experts else "config.has_shared_experts is False")
    expect_array(norm_weight, "norm_weight", [(latent,)], config.dtype, f"L={latent}",
                 none_because=None if config.use_latent_norm else "config.use_latent_norm is False")

    kernel_shapes = [(latent, hidden)]
    padded = padded_hidden_size(hidden, tp_size)
    if weight_layout == "column" and padded != hidden:
        kernel_shapes.append((latent, padded))
    check_up_proj_kernel(up_proj_kernel, dtype=config.dtype, up_proj_dtype=config.up_proj_dtype, shapes=kernel_shapes,
                         sizes=f"L={latent}, H={hidden}, p={tp_size}")
    return num_tokens
