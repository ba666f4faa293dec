"""A float64 numpy reference of the Kimi-K3 latent MoE layer (the function k3_tail/models/kimi_k3/layer.py's
docstring states; at k = 1 the weight is the score itself), independent of JAX and of the layer's code: whole
weights, one token and one chosen expert at a time, no rounding between steps.
"""

from collections.abc import Mapping

import numpy as np


def reference_layer(weights: Mapping[str, np.ndarray], hidden_states: np.ndarray, *, top_k: int,
                    rms_norm_eps: float, routed_scaling_factor: float) -> np.ndarray:
    """y [T, H] in float64 for hidden_states [T, H] and whole weights: router_kernel [H, E], router_bias [E],
    down_proj [H, L], expert_gate and expert_up [E, L, m], expert_down [E, m, L], shared_gate and shared_up
    [H, F], shared_down [F, H], norm_scale [L], up_proj_kernel [L, H] (and up_proj_scale [H] for FP8 values)."""
    routed, shared = reference_partials(weights, hidden_states, top_k=top_k)
    latent = routed_scaling_factor * routed
    rms = np.sqrt(np.mean(latent * latent, axis=-1, keepdims=True) + rms_norm_eps)
    normed = latent / rms * np.asarray(weights["norm_scale"], np.float64)
    kernel = np.asarray(weights["up_proj_kernel"], np.float64)
    if "up_proj_scale" in weights:  # an FP8 kernel: its values times their per-column scales
        kernel = kernel * np.asarray(weights["up_proj_scale"], np.float64)
    return normed @ kernel + shared


def reference_partials(weights: Mapping[str, np.ndarray], hidden_states: np.ndarray, *,
                       top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(r [T, L], s [T, H]) in float64: what the TP ranks' routed and shared partials add up to."""
    w = {name: np.asarray(value, np.float64) for name, value in weights.items()}
    x = np.asarray(hidden_states, np.float64)
    scores = _sigmoid(x @ w["router_kernel"])
    chosen = np.argsort(-(scores + w["router_bias"]), axis=1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(scores, chosen, axis=1)
    combine = picked / picked.sum(axis=1, keepdims=True) if top_k > 1 else picked  # top 1: the score itself
    routed = reference_routed_experts(x @ w["down_proj"], chosen, combine, w["expert_gate"], w["expert_up"],
                                      w["expert_down"])
    return routed, _situ_mlp(x, w["shared_gate"], w["shared_up"], w["shared_down"])


def reference_routed_experts(latent: np.ndarray, chosen: np.ndarray, combine: np.ndarray, gate: np.ndarray,
                             up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """r [T, L] in float64, one (token, chosen expert) pair at a time, for latent [T, L], chosen and combine
    [T, k], gate and up [E, L, m], down [E, m, L] (whole experts)."""
    gate, up, down = (np.asarray(kernel, np.float64) for kernel in (gate, up, down))
    latent = np.asarray(latent, np.float64)
    routed = np.zeros_like(latent)
    for token in range(latent.shape[0]):
        for expert, weight in zip(chosen[token], combine[token], strict=True):
            routed[token] += weight * _situ_mlp(latent[token], gate[expert], up[expert], down[expert])
    return routed


def choice_margin(weights: Mapping[str, np.ndarray], hidden_states: np.ndarray, *, top_k: int) -> float:
    """The smallest gap, over the tokens, between the k-th and the (k+1)-th largest biased score (inf
    when k = E): inputs with a margin far above float32's rounding choose the same experts in any
    precision."""
    biased = (_sigmoid(np.asarray(hidden_states, np.float64) @ np.asarray(weights["router_kernel"], np.float64))
              + np.asarray(weights["router_bias"], np.float64))
    if top_k == biased.shape[1] or biased.shape[0] == 0:
        return float("inf")
    ordered = -np.sort(-biased, axis=1)
    return float(np.min(ordered[:, top_k - 1] - ordered[:, top_k]))


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def _situ_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g, u = x @ gate, x @ up
    return (4.0 * np.tanh(g / 4.0) * _sigmoid(g) * 25.0 * np.tanh(u / 25.0)) @ down
