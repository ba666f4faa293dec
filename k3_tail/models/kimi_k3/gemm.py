"""The one matrix product of the Kimi-K3 layer: every GEMM of its layer and routed experts is :func:`matmul`."""

import jax
import jax.numpy as jnp

from k3_tail.ops.up_projection import gemm_rows


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` (``jnp.matmul``: [..., R, K] x [..., K, N] -> [..., R, N]) accumulated in and returned as float32."""
    # One row is multiplied as two (docs/design.md, "Two GEMM forms XLA is kept from"): XLA's GPU pipeline rewrites
    # a one-row dot with a narrow kernel into a multiply and a reduce, which on ROCm writes a float32 kernel copy.
    rows = a.shape[-2]
    padding = [(0, 0)] * (a.ndim - 2) + [(0, gemm_rows(rows) - rows), (0, 0)]
    return jnp.matmul(jnp.pad(a, padding), b, preferred_element_type=jnp.float32)[..., :rows, :]
