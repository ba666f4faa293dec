"""The global-array entry point: validate, place on the mesh, select a tier, run it under shard_map."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail.column_parallel import column_parallel_tail
from k3_tail.columns import check_weight_layout, pad_columns, padded_hidden_size
from k3_tail.config import TailConfig
from k3_tail.native import native_tail
from k3_tail.one_shot import one_shot_tail
from k3_tail.overlap import overlap_tail
from k3_tail.scatter_gather import scatter_gather_tail
from k3_tail.selection import Tier, select_tier
from k3_tail.sequence_parallel import padded_token_count

_TIER_FUNCTIONS = {
    Tier.NATIVE: native_tail,
    Tier.OVERLAP: overlap_tail,
    Tier.COLUMN_PARALLEL: column_parallel_tail,
    Tier.SCATTER_GATHER: scatter_gather_tail,
    Tier.ONE_SHOT: one_shot_tail,
}


def tail_forward(
    routed_partials,
    shared_partials,
    norm_weight,
    up_proj_kernel,
    *,
    config: TailConfig,
    mesh: Mesh,
    axis_name: str = "tp",
    tier: Tier | str | None = None,
    weight_layout: str = "replicated",
) -> jax.Array:
    """``y = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i`` on ``mesh``, by one of the tiers.

    Args (numpy or jax arrays in any sharding, all of dtype ``config.dtype``; they are placed here):
      routed_partials: [p, T, L], entry i is TP rank i's routed latent partial; [T, L] (the reduced
        latent) when ``config.fused_output_is_reduced``.
      shared_partials: [p, T, H], entry i is rank i's shared-expert partial; None exactly when
        ``config.has_shared_experts`` is False.
      norm_weight: [L] RMSNorm scale g; None exactly when ``config.use_latent_norm`` is False.
      up_proj_kernel: [L, H] up projection (Flax layout, y = x @ W). With ``weight_layout="column"``
        it may also be the padded [L, padded_hidden_size(H, p)] storage of :class:`LatentMoETail`.
      config: the tail's :class:`TailConfig`; mesh: a Mesh with axis ``axis_name`` of size p (other
        axes replicate the computation).
      tier: a :class:`Tier` (or its value) to force, or None to let :func:`select_tier` decide at
        trace time.
      weight_layout: where the kernel lives during the call: "replicated" (whole on every rank) or
        "column" (P(None, axis_name): each rank holds [L, H/p]); see :mod:`k3_tail.columns`. The
        one_shot tier needs "replicated".

    Returns y: [T, H] in ``config.dtype``, replicated over the mesh; with ``config.sequence_parallel``
    sharded over ``axis_name`` on its token dimension (rank k holds rows [k*T/p, (k+1)*T/p)). JAX
    arrays shard evenly only, so when p does not divide T the tokens are padded for the tier's
    reduce-scatter and the T rows are then gathered: replicated, as :func:`select_tier`'s reason says.
    T = 0 gives an empty [0, H].
    Bad shapes, dtypes, a mesh without the axis or a wrong p raise ValueError naming the argument.
    Works eagerly (compiled once per shape and placement) and under ``jax.jit``; never modifies or
    donates its inputs.
    """
    if not isinstance(config, TailConfig):
        raise ValueError(f"config: expected a k3_tail.TailConfig, got {type(config).__name__}")
    check_mesh(mesh, axis_name)
    parsed_tier = None if tier is None else Tier.parse(tier)
    return _tail_forward_jit(
        routed_partials,
        shared_partials,
        norm_weight,
        up_proj_kernel,
        config=config,
        mesh=mesh,
        axis_name=axis_name,
        tier=parsed_tier,
        weight_layout=check_weight_layout(weight_layout),
    )


def check_mesh(mesh: Mesh, axis_name: str) -> int:
    """The size p of ``mesh`` along ``axis_name``, or ValueError when it is no Mesh with that axis."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"mesh: expected a mesh axis named {axis_name!r} (axis_name), got axes {mesh.axis_names}")
    return mesh.shape[axis_name]


@functools.partial(jax.jit, static_argnames=("config", "mesh", "axis_name", "tier", "weight_layout"))
def _tail_forward_jit(routed_partials, shared_partials, norm_weight, up_proj_kernel, *, config, mesh, axis_name, tier,
                      weight_layout):
    tp_size = mesh.shape[axis_name]
    num_tokens = _check_inputs(
        routed_partials, shared_partials, norm_weight, up_proj_kernel,
        config=config, tp_size=tp_size, weight_layout=weight_layout,
    )
    if tier is None:
        tier = select_tier(
            config, num_tokens, tp_size, weight_layout=weight_layout, device_kind=mesh.devices.flat[0].device_kind
        ).tier
    if weight_layout == "column":
        up_proj_kernel = pad_columns(up_proj_kernel, padded_hidden_size(config.hidden_size, tp_size))

    if config.sequence_parallel:
        # Zero token rows up to a multiple of p, so each rank owns T/p rows; they are sliced off below.
        padding = padded_token_count(num_tokens, tp_size) - num_tokens
        token_axis = 0 if config.fused_output_is_reduced else 1
        routed_partials = _pad_axis(routed_partials, token_axis, padding)
        shared_partials = None if shared_partials is None else _pad_axis(shared_partials, 1, padding)

    routed_spec = P() if config.fused_output_is_reduced else P(axis_name)
    specs = (routed_spec, P(axis_name), P(), P(None, axis_name) if weight_layout == "column" else P())
    args = tuple(
        None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
        for x, spec in zip((routed_partials, shared_partials, norm_weight, up_proj_kernel), specs, strict=True)
    )
    tier_function = functools.partial(
        _TIER_FUNCTIONS[tier], config=config, axis_name=axis_name, weight_layout=weight_layout
    )

    def per_rank(routed, shared, norm, kernel):
        # The per-rank partials arrive as [1, T, X] blocks of the [p, T, X] globals.
        routed = routed if config.fused_output_is_reduced else routed[0]
        return tier_function(routed, None if shared is None else shared[0], norm, kernel)

    in_specs = tuple(None if x is None else spec for x, spec in zip(args, specs, strict=True))
    out_spec = P(axis_name) if config.sequence_parallel else P()
    y = jax.shard_map(per_rank, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(*args)
    if not config.sequence_parallel or y.shape[0] == num_tokens:
        return y
    # JAX arrays shard evenly only: T rows that p does not divide can only be returned replicated.
    return jax.sharding.reshard(y, NamedSharding(mesh, P()))[:num_tokens]


def _pad_axis(x, axis: int, padding: int):
    if not padding:
        return x
    widths = [(0, 0)] * np.ndim(x)
    widths[axis] = (0, padding)
    return jnp.pad(x, widths)


def _check_inputs(routed_partials, shared_partials, norm_weight, up_proj_kernel, *, config, tp_size, weight_layout):
    """Validate shapes and dtypes against the config and p; return T."""
    hidden, latent = config.hidden_size, config.latent_size
    routed_shape = np.shape(routed_partials)
    if config.fused_output_is_reduced:
        _expect_rank(routed_partials, "routed_partials", "[T, L] (the reduced latent: fused_output_is_reduced)", 2)
        num_tokens = routed_shape[0]
        expected_routed = (num_tokens, latent)
    else:
        _expect_rank(routed_partials, "routed_partials", "[p, T, L]", 3)
        num_tokens = routed_shape[1]
        expected_routed = (tp_size, num_tokens, latent)
    _expect(routed_partials, "routed_partials", [expected_routed], config.dtype, f"p={tp_size}, L={latent}")

    if config.has_shared_experts:
        _expect(shared_partials, "shared_partials", [(tp_size, num_tokens, hidden)], config.dtype,
                f"p={tp_size}, T={num_tokens}, H={hidden}")
    elif shared_partials is not None:
        raise ValueError("shared_partials: expected None because config.has_shared_experts is False")

    if config.use_latent_norm:
        _expect(norm_weight, "norm_weight", [(latent,)], config.dtype, f"L={latent}")
    elif norm_weight is not None:
        raise ValueError("norm_weight: expected None because config.use_latent_norm is False")

    kernel_shapes = [(latent, hidden)]
    padded = padded_hidden_size(hidden, tp_size)
    if weight_layout == "column" and padded != hidden:
        kernel_shapes.append((latent, padded))
    _expect(up_proj_kernel, "up_proj_kernel", kernel_shapes, config.dtype, f"L={latent}, H={hidden}, p={tp_size}")
    return num_tokens


def _expect_rank(x, name, layout, ndim):
    if x is None or not hasattr(x, "shape") or len(x.shape) != ndim:
        got = "None" if x is None else f"shape {tuple(np.shape(x))}"
        raise ValueError(f"{name}: expected a {ndim}-d array {layout}, got {got}")


def _expect(x, name, shapes, dtype, sizes):
    if x is None or not hasattr(x, "shape"):
        raise ValueError(f"{name}: expected an array of shape {shapes[0]}, got {type(x).__name__}")
    if tuple(x.shape) not in shapes:
        wanted = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name}: expected shape {wanted} ({sizes}), got {tuple(x.shape)}")
    if jnp.dtype(x.dtype) != dtype:
        raise ValueError(f"{name}: expected dtype {dtype.name} (config.dtype), got {jnp.dtype(x.dtype).name}")
