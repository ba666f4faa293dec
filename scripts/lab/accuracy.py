"""What accuracy experiments compare with: random tail inputs and the float64 tail on the host.

Inputs are drawn as the tests draw them, so that the routed and the shared term each carry about half
of y: routed partials randn / sqrt(p) [p, T, L], shared partials randn / sqrt(p) [p, T, H], norm
weight 1 + 0.1 randn [L], kernel randn / sqrt(L) [L, H], all rounded to the config's dtype (numpy
arrays; bfloat16 through ml_dtypes).
"""

from __future__ import annotations

import numpy as np

from k3_tail.config import TailConfig


def random_weights(config: TailConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(norm weight [L], kernel [L, H]) in ``config.dtype``, the kernel drawn first."""
    latent, hidden = config.latent_size, config.hidden_size
    kernel = rng.standard_normal((latent, hidden), dtype=np.float32) / np.sqrt(latent)
    norm_weight = 1 + 0.1 * rng.standard_normal(latent, dtype=np.float32)
    return norm_weight.astype(config.dtype), kernel.astype(config.dtype)


def random_partials(config: TailConfig, tp_size: int, num_tokens: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(routed [p, T, L], shared [p, T, H]) partials in ``config.dtype``, rank i's at index i."""
    shapes = ((tp_size, num_tokens, config.latent_size), (tp_size, num_tokens, config.hidden_size))
    routed, shared = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(tp_size) for shape in shapes)
    return routed.astype(config.dtype), shared.astype(config.dtype)


def reference_latent(config: TailConfig, routed: np.ndarray, norm_weight: np.ndarray) -> np.ndarray:
    """RMSNorm_g(c * sum_i r_i) in float64 [T, L] (c * sum_i r_i without ``config.use_latent_norm``), summed
    rank by rank (no float64 copy of the partials)."""
    latent = np.zeros(routed.shape[1:], np.float64)
    for partial in routed:
        latent += partial.astype(np.float64)
    latent *= config.routed_scaling_factor
    if config.use_latent_norm:
        latent *= norm_weight.astype(np.float64) / np.sqrt(np.mean(latent * latent, axis=-1, keepdims=True)
                                                           + config.rms_norm_eps)
    return latent


def reference_tail(config: TailConfig, routed: np.ndarray, shared: np.ndarray, norm_weight: np.ndarray,
                   kernel: np.ndarray) -> np.ndarray:
    """y = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i in float64 [T, H]."""
    y = reference_latent(config, routed, norm_weight) @ np.asarray(kernel, np.float64)
    for partial in shared:
        y += partial.astype(np.float64)
    return y


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected||_F / ||expected||_F, in float64."""
    difference = np.asarray(actual, np.float64) - expected
    return float(np.linalg.norm(difference) / np.linalg.norm(expected))
