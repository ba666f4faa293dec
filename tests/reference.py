"""An independent float64 numpy reference of the tail, and the inputs the tests feed it.

An FP8 kernel enters the reference as its values times its scales, in float64.

    y = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i,   RMSNorm_g(x) = x / sqrt(mean(x^2) + eps) * g
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

import k3_tail
import k3_tail.ops.codecs

# Relative Frobenius error allowed against the float64 reference, per activation dtype.
# bf16 rounds each of the ~5 steps (two reductions, norm, GEMM output, add) to 2^-9 relative;
# 1e-2 leaves headroom over the ~3e-3 seen, and is far tighter than vLLM's atol 8e-2.
TOLERANCE = {np.dtype(jnp.bfloat16): 1e-2, np.dtype(jnp.float32): 1e-5}
# With fp8_activations the normalised latent is rounded per token to FP8 (3 mantissa bits): against the
# reference with the same (dequantised) kernel that costs about 1.9e-2 of y at Kimi-K3's shapes and
# about 1e-2 at the tests' (measured, scripts/fp8_error.py); 4e-2 leaves headroom.
FP8_ACTIVATIONS_TOLERANCE = 4e-2


# A quantised sum's rounding is predicted from the codec (quantisation_noise); a tier may have twice it.
QUANTIZATION_MARGIN = 2.0


def tolerance(config, inputs=None):
    """The relative error a tier may have against :func:`reference_tail` with ``config``: the dtype's
    (or FP8 activations') tolerance, plus with quantised sums ``QUANTIZATION_MARGIN`` times the
    rounding noise the codec predicts for ``inputs`` (:func:`quantisation_noise`)."""
    limit = FP8_ACTIVATIONS_TOLERANCE if config.fp8_activations else TOLERANCE[config.dtype]
    if config.all_reduce_quantization is None:
        return limit
    return limit + QUANTIZATION_MARGIN * quantisation_noise(config, inputs)


def block_maxima(values):
    """max |x| over each block of 32 consecutive values of ``values`` flattened (zero-padded), float64."""
    flat = np.abs(np.asarray(values, np.float64)).reshape(-1)
    return np.pad(flat, (0, -flat.size % 32)).reshape(-1, 32).max(axis=1)


def sum_rounding_noise(codec, partials):
    """The predicted RMS error (absolute, Frobenius) of a quantised two-shot sum of ``partials`` [p, ...].

    Each value is rounded to a multiple of its block's step, step = m / 2^(b-1) (m: the block's
    largest magnitude), once in its rank's partial and once more in the sum. Rounding noise is
    uniform over a step, so each rounding adds step^2 / 12 of variance, independently:
        ||e||^2 = sum over blocks of 32 * (sum_i step_i^2 + step_sum^2) / 12.
    """
    step = k3_tail.ops.codecs.CODECS[codec].relative_step
    partials = np.asarray(partials, np.float64)
    squares = sum(np.sum(block_maxima(partial) ** 2) for partial in partials)
    squares += np.sum(block_maxima(partials.sum(axis=0)) ** 2)
    return step * np.sqrt(32 * squares / 12)


def quantisation_noise(config, inputs):
    """The relative error of y that quantising the tail's two sums predicts for ``inputs``.

    The routed sum's error passes through the norm (scale-invariant: its relative size at most) and the
    projection (a random kernel keeps it), so it costs y_r = norm(x) W its relative error; the shared
    sum's adds to y as it is. Every tier rounds each term in about this measure (whichever buffer
    carries it: column_parallel's stitched sum and one_shot's packed one hold the same values in
    other places). Zero on one rank, where nothing is sent.
    """
    routed = np.asarray(inputs.routed, np.float64)
    if routed.shape[0] == 1 or routed.size == 0:
        return 0.0
    codec = config.all_reduce_quantization
    y_routed = reference_latent(config, inputs.routed, inputs.norm_weight) @ kernel_matrix(inputs.kernel)
    x = config.routed_scaling_factor * routed.sum(axis=0)
    squared = (sum_rounding_noise(codec, config.routed_scaling_factor * routed) / np.linalg.norm(x)
               * np.linalg.norm(y_routed)) ** 2
    if inputs.shared is not None and not config.shared_output_is_reduced:
        squared += sum_rounding_noise(codec, inputs.shared) ** 2
    return float(np.sqrt(squared) / np.linalg.norm(reference_tail(config, inputs)))


@dataclasses.dataclass(frozen=True)
class TailInputs:
    """Global inputs of one tail call, in the config's dtype."""

    routed: np.ndarray  # [p, T, L]
    shared: np.ndarray  # [p, T, H]
    norm_weight: np.ndarray  # [L]
    kernel: np.ndarray | k3_tail.QuantizedKernel  # [L, H]; quantised when config.up_proj_dtype is FP8


def make_inputs(config, tp_size, num_tokens, seed=0):
    """Random inputs where the routed and the shared term both carry about half of y.

    (vLLM's r = 0.01 * randn would leave the routed term at 1% of y: a tier that dropped it would
    pass a 1e-2 tolerance without the norm.) The kernel is quantised when ``config.up_proj_dtype`` is FP8.
    """
    rng = np.random.default_rng(seed)
    latent, hidden = config.latent_size, config.hidden_size

    def cast(x):
        return np.asarray(jnp.asarray(x, config.dtype))

    return TailInputs(
        routed=cast(rng.standard_normal((tp_size, num_tokens, latent)) / np.sqrt(tp_size)),
        shared=cast(rng.standard_normal((tp_size, num_tokens, hidden)) / np.sqrt(tp_size)),
        norm_weight=cast(1.0 + 0.1 * rng.standard_normal(latent)),
        kernel=quantized(config, cast(rng.standard_normal((latent, hidden)) / np.sqrt(latent))),
    )


def quantized(config, kernel):
    """``kernel`` as the config stores it: unchanged, or quantised to ``config.up_proj_dtype``."""
    return kernel if config.up_proj_dtype is None else k3_tail.quantize_up_proj(kernel, config.up_proj_dtype)


def kernel_matrix(kernel):
    """The [L, H] kernel a tail computes with, in float64: a QuantizedKernel's values times its scales."""
    if isinstance(kernel, k3_tail.QuantizedKernel):
        return np.asarray(kernel.values, np.float64) * np.asarray(kernel.scale, np.float64)
    return np.asarray(kernel, np.float64)


def reference_latent(config, routed, norm_weight):
    """The normalised latent [T, L] in float64 from per-rank partials [p, T, L]."""
    x = config.routed_scaling_factor * np.asarray(routed, np.float64).sum(axis=0)
    if not config.use_latent_norm:
        return x
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps)
    return x / rms * np.asarray(norm_weight, np.float64)


# The tail inputs with one term dropped or misread; each must miss the reference by far more than 1e-2.
WRONG_TAILS = {
    "without_shared": lambda config, inputs: (config, dataclasses.replace(inputs, shared=None)),
    "without_routed": lambda config, inputs: (
        config, dataclasses.replace(inputs, routed=np.zeros_like(inputs.routed))
    ),
    "one_rank_routed": lambda config, inputs: (config, dataclasses.replace(inputs, routed=inputs.routed[:1])),
    "unscaled": lambda config, inputs: (dataclasses.replace(config, routed_scaling_factor=1.0), inputs),
}


def reference_tail(config, inputs):
    """y [T, H] in float64."""
    latent = reference_latent(config, inputs.routed, inputs.norm_weight)
    y = latent @ kernel_matrix(inputs.kernel)
    if inputs.shared is not None:
        y = y + np.asarray(inputs.shared, np.float64).sum(axis=0)
    return y


def relative_error(actual, expected):
    """||actual - expected||_F / ||expected||_F, in float64."""
    expected = np.asarray(expected, np.float64)
    return np.linalg.norm(np.asarray(actual, np.float64) - expected) / np.linalg.norm(expected)
