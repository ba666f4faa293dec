"""The one matrix product of the Kimi-K3 example layer: every GEMM of k3_tail/models/kimi_k3/layer.py and
k3_tail/models/kimi_k3/routed_experts.py is :func:`matmul`.

A product with one row ([1, K] x [K, N] at T = 1: the router, the down projection, the shared experts'
three kernels; [S, 1, K] x [S, K, N] for a capacity of one) is multiplied as two rows, the second zero,
and the zero row's result dropped, as the tail's up projection does (``k3_tail.ops.up_projection``,
``gemm_rows``; docs/design.md, "One-row GEMMs"). XLA's GPU pipeline rewrites a dot with one vector side
and a narrow kernel ((N + 1) K < 1e7: the router [7168, 896] and the shared experts' [7168, 768] and
[768, 7168] blocks) into a multiply and a reduce; on ROCm the multiply stays a fusion of its own that
writes a float32 copy of the kernel (22 MB for each shared-expert block, two live at once), which the
reduce reads back. With two rows it stays one GEMM that reads the kernel once in its stored dtype.
"""

import jax
import jax.numpy as jnp

from k3_tail.ops.up_projection import gemm_rows


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` (``jnp.matmul``: [..., R, K] x [..., K, N] -> [..., R, N], batch dimensions first)
    accumulated in and returned as float32; a single row (R = 1) is multiplied as two (module
    docstring)."""
    rows = a.shape[-2]
    padding = [(0, 0)] * (a.ndim - 2) + [(0, gemm_rows(rows) - rows), (0, 0)]
    return jnp.matmul(jnp.pad(a, padding), b, preferred_element_type=jnp.float32)[..., :rows, :]
