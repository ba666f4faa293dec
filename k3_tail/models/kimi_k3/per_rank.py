"""The Kimi-K3 layer on one TP rank, inside its ``jax.shard_map``: its partials, then the tail on them. Nothing
here but the tail and the shared reduction issues a collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

import k3_tail
from k3_tail.models.kimi_k3 import mxfp4_experts as kimi_k3_mxfp4
from k3_tail.models.kimi_k3.decode_experts import decode_experts
from k3_tail.models.kimi_k3.gemm import matmul
from k3_tail.models.kimi_k3.layer_config import LayerConfig
from k3_tail.models.kimi_k3.packed_parameters import INPUT_KERNEL, RANK, input_columns
from k3_tail.models.kimi_k3.parameters import ROUTED_EXPERT_SCALES, ROUTED_EXPERT_WEIGHTS
from k3_tail.models.kimi_k3.routed_experts import ROUTED_EXPERTS, routed_expert_method
from k3_tail.models.kimi_k3.situ import situ


def route(hidden_states: jax.Array, router_kernel: jax.Array, correction_bias: jax.Array, *,
          top_k: int) -> tuple[jax.Array, jax.Array]:
    """(chosen [T, k] expert ids, combine weights [T, k] float32) of hidden_states [T, H]: the bias only chooses;
    the weights are the chosen un-biased sigmoid scores, renormalised to sum 1 when top_k > 1 (at top_k = 1 the
    score itself, as in Kimi-K3's reference, MaxText and tpu-inference)."""
    return route_logits(matmul(hidden_states, router_kernel), correction_bias, top_k=top_k)


def route_logits(logits: jax.Array, correction_bias: jax.Array, *, top_k: int) -> tuple[jax.Array, jax.Array]:
    """:func:`route` from the router's logits [T, E] float32 (x @ W_router)."""
    scores = jax.nn.sigmoid(logits)
    _, chosen = jax.lax.top_k(scores + correction_bias, top_k)
    picked = scores[jnp.arange(scores.shape[0])[:, None], chosen]
    return chosen, picked / picked.sum(axis=1, keepdims=True) if top_k > 1 else picked


class InputProducts(NamedTuple):
    """x [T, H] @ this rank's ``input_kernel`` split by kernel: logits [T, E] float32, the routed latent z [T, L]
    in the dtype, the shared gate and up products [T, F/p] float32."""

    logits: jax.Array
    latent: jax.Array
    shared_gate: jax.Array
    shared_up: jax.Array


def input_products(parameters: Mapping[str, jax.Array], hidden_states: jax.Array) -> jax.Array:
    """x @ input_kernel, float32 [T, W], W = E + L + 2F/p, for this rank's ``parameters`` and the replicated
    ``hidden_states`` [T, H]: one GEMM, 2 T H W FLOPs over d H W weight bytes."""
    return matmul(hidden_states, parameters[INPUT_KERNEL])


def split_products(products: jax.Array, config: LayerConfig) -> InputProducts:
    """:func:`input_products`' columns by kernel (slices, which XLA fuses into their consumers)."""
    logits, latent, gate, up = input_columns(products, config)
    return InputProducts(logits, latent.astype(config.dtype), gate, up)


def routed_inputs(products: jax.Array, config: LayerConfig) -> jax.Array | InputProducts:
    """What the routed experts read of the :func:`input_products`: at decode (gather) the products whole, which a
    GPU's kernels read; else only the logits and z, so no more is carried past the early shared reduction."""
    if routed_expert_method(config, products.shape[0]).method == "gather":
        return products
    split = split_products(products, config)
    return split._replace(shared_gate=None, shared_up=None)


def routed_partial(parameters: Mapping[str, jax.Array], products: jax.Array | InputProducts, *, config: LayerConfig,
                   layer_index: jax.Array | None = None) -> jax.Array:
    """This rank's routed latent partial r_i [T, L] in the config's dtype, from :func:`routed_inputs`.
    ``layer_index``: in a stack, the layer's index into the ``STACKED_IN_PLACE`` arrays [N, ...]."""
    split_first = isinstance(products, InputProducts)
    method = routed_expert_method(config, (products.logits if split_first else products).shape[0]).method
    kernels = routed_expert_kernels(parameters)

    quantized = tuple(isinstance(kernel, kimi_k3_mxfp4.Mxfp4Kernel) for kernel in kernels)

    def in_xla_at(layer, products, bias, *arrays):
        if layer is not None:
            arrays = [array[layer] for array in arrays]
        split = products if split_first else split_products(products, config)
        chosen, combine = route_logits(split.logits, bias, top_k=config.top_k)
        routed = ROUTED_EXPERTS[method](split.latent, chosen, combine, *_as_kernels(quantized, arrays))
        return routed.astype(config.dtype)

    # Differentiated as XLA's route: the Pallas kernels compute its function and have no derivative rule of their own.
    @jax.custom_vjp
    def in_two_kernels_at(layer, products, bias, *arrays):
        return decode_experts(products, bias, *_as_kernels(quantized, arrays), num_experts=config.num_experts,
                              top_k=config.top_k, dtype=config.dtype, layer=layer)

    def forward(layer, products, bias, *arrays):
        return in_two_kernels_at(layer, products, bias, *arrays), (layer, products, bias, arrays)

    def backward(residuals, cotangent):
        layer, products, bias, arrays = residuals
        floating = [jnp.issubdtype(array.dtype, jnp.floating) for array in arrays]

        def of_floats(products, bias, *floats):
            floats = iter(floats)
            every = [next(floats) if is_float else array for array, is_float in zip(arrays, floating, strict=True)]
            return in_xla_at(layer, products, bias, *every)

        _, vjp = jax.vjp(of_floats, products, bias, *[a for a, f in zip(arrays, floating, strict=True) if f])
        products_bar, bias_bar, *floats_bar = vjp(cotangent)
        floats_bar = iter(floats_bar)
        return (None, products_bar, bias_bar, *[next(floats_bar) if is_float else None for is_float in floating])

    in_two_kernels_at.defvjp(forward, backward)
    arrays = [array for kernel in kernels for array in kimi_k3_mxfp4.kernel_arrays(kernel)]
    if method != "gather" or split_first:
        return in_xla_at(layer_index, products, parameters["router_bias"], *arrays)
    # At decode a GPU routes and runs the experts in two Pallas kernels (decode_experts); elsewhere XLA's gather.
    return jax.lax.platform_dependent(layer_index, products, parameters["router_bias"], *arrays,
                                      cuda=in_two_kernels_at, rocm=in_two_kernels_at, default=in_xla_at)


def routed_expert_kernels(parameters: Mapping[str, jax.Array]) -> tuple[jax.Array | kimi_k3_mxfp4.Mxfp4Kernel, ...]:
    """(gate, up, down) as the routed-expert methods take them: the arrays, or MXFP4 codes with their scales."""
    if ROUTED_EXPERT_SCALES["expert_gate"] in parameters:
        return tuple(kimi_k3_mxfp4.Mxfp4Kernel(parameters[name], parameters[scale])
                     for name, scale in ROUTED_EXPERT_SCALES.items())
    return tuple(parameters[name] for name in ROUTED_EXPERT_WEIGHTS)


def _as_kernels(quantized, arrays) -> list:
    """The expert kernels rebuilt on ``arrays`` (their arrays, in order): MXFP4 where ``quantized`` says so."""
    arrays, rebuilt = iter(arrays), []
    for is_mxfp4 in quantized:
        if is_mxfp4:
            rebuilt.append(kimi_k3_mxfp4.Mxfp4Kernel(next(arrays), next(arrays)))
        else:
            rebuilt.append(next(arrays))
    return rebuilt


def shared_partial(parameters: Mapping[str, jax.Array], products: jax.Array, *, config: LayerConfig) -> jax.Array:
    """This rank's shared-expert partial s_i [T, H] in the config's dtype, from the :func:`input_products`."""
    split = split_products(products, config)
    activation = situ(split.shared_gate, split.shared_up).astype(config.dtype)
    return matmul(activation, parameters["shared_down"]).astype(config.dtype)


def rank_partials(parameters: Mapping[str, jax.Array], hidden_states: jax.Array, *,
                  config: LayerConfig) -> tuple[jax.Array, jax.Array]:
    """(routed latent partial r_i [T, L], shared partial s_i [T, H]) of this rank, in the config's dtype."""
    products = input_products(parameters, hidden_states)
    return (routed_partial(parameters, products, config=config),
            shared_partial(parameters, products, config=config))


def layer_per_rank(parameters: Mapping[str, jax.Array], hidden_states: jax.Array, *, config: LayerConfig,
                   axis_name: str, weight_layout: str, tier: k3_tail.Tier | str | None,
                   device: jax.Device, layer_index: jax.Array | None = None) -> jax.Array:
    """This rank's y: its partials, then ``k3_tail.latent_moe_tail`` on them; with ``config.early_shared_reduction``
    ``k3_tail.reduce_shared`` sums the shared partials while the routed experts compute. ``layer_index``: as
    :func:`routed_partial` takes it.

    Returns [T, H], or with token-sharded output (``k3_tail.is_token_sharded_output``) this rank's [T'/p, H] rows
    of y padded to T' = ``k3_tail.padded_token_count(T, p)`` rows.
    """
    products = input_products(parameters, hidden_states)
    shared = shared_partial(parameters, products, config=config)
    routed_in = routed_inputs(products, config)
    if config.early_shared_reduction:
        # Ordering barriers (no kernel) keep XLA's schedule from moving the reduction out of the routed work: the
        # routed inputs wait for the shared partial, and the routed partial for the reduced shared output.
        routed_in, shared = jax.lax.optimization_barrier((routed_in, shared))
        shared = k3_tail.reduce_shared(shared, config=config.tail, axis_name=axis_name, device=device)
    routed = routed_partial(parameters, routed_in, config=config, layer_index=layer_index)
    if config.early_shared_reduction:
        routed, _ = jax.lax.optimization_barrier((routed, shared))
    return k3_tail.latent_moe_tail(routed, shared, parameters["norm_scale"], up_projection(parameters),
                                   config=config.tail, axis_name=axis_name, weight_layout=weight_layout, tier=tier,
                                   device=device, rank=parameters[RANK])


def up_projection(parameters: Mapping[str, jax.Array]) -> jax.Array | k3_tail.QuantizedKernel:
    """The up projection as the tail takes it: the kernel, or its FP8 values with their scales."""
    if "up_proj_scale" in parameters:
        return k3_tail.QuantizedKernel(parameters["up_proj_kernel"], parameters["up_proj_scale"])
    return parameters["up_proj_kernel"]
