"""Row counts at which hipBLASLt's C-accumulating bf16 GEMM has faulted: run only on a ROCm host.

vLLM's ROCm runner stopped using a GEMM that accumulates into C (``addmm_``) in this tail because
hipBLASLt faulted at some row counts: 23393-23405 rows of [rows, 3584] x [3584, 896] (the column
tier's GEMM at TP8) and 2914-2925 rows of [rows, 3584] x [3584, 7168] (the full projection; the
token-parallel tier's GEMM at TP8 has T/8 rows). XLA's library GEMM path folds "dot + add" into such a
GEMM (beta = 1, output aliased to C); on ROCm the tiers keep the add out of it, which
tests/test_rocm_gemms.py asserts on the compiled programs. ``scripts/rocm_check.sh`` still runs these
tiers at those row counts against the float64 reference on the host (on a sample of rows: every row is
independent, and the whole reference would take minutes on the host).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3_tail
from helpers import make_tp_mesh
from reference import TOLERANCE, TailInputs, reference_tail, relative_error

P = 8
CASES = [
    *(pytest.param("column_parallel", "column", False, rows, id=f"column_parallel-{rows}")
      for rows in (23393, 23399, 23405)),
    *(pytest.param("token_parallel", "replicated", True, P * rows, id=f"token_parallel-{rows}-per-rank")
      for rows in (2914, 2920, 2925)),
]


def device_inputs(config, num_tokens):
    """The tail's inputs drawn on the device (the host would need tens of GB for them in float64)."""
    keys = jax.random.split(jax.random.key(0), 4)
    latent, hidden = config.latent_size, config.hidden_size

    def normal(key, shape, scale, shift=0.0):
        return (shift + scale * jax.random.normal(key, shape, jnp.float32)).astype(config.dtype)

    return (normal(keys[0], (P, num_tokens, latent), P ** -0.5), normal(keys[1], (P, num_tokens, hidden), P ** -0.5),
            normal(keys[2], (latent,), 0.1, 1.0), normal(keys[3], (latent, hidden), latent ** -0.5))


@pytest.mark.rocm
@pytest.mark.parametrize(("tier", "weight_layout", "sequence_parallel", "num_tokens"), CASES)
def test_tier_is_right_at_a_row_count_where_hipblaslt_faulted(tier, weight_layout, sequence_parallel, num_tokens):
    config = k3_tail.TailConfig.kimi_k3(sequence_parallel=sequence_parallel)
    routed, shared, norm_weight, kernel = device_inputs(config, num_tokens)
    y = k3_tail.tail_forward(routed, shared, norm_weight, kernel, config=config, mesh=make_tp_mesh(P), tier=tier,
                             weight_layout=weight_layout)
    rows = np.unique(np.r_[0:64, num_tokens - 64:num_tokens, 64:num_tokens - 64:997])
    sample = TailInputs(np.asarray(routed[:, rows]), np.asarray(shared[:, rows]), np.asarray(norm_weight),
                        np.asarray(kernel))
    assert y.shape == (num_tokens, config.hidden_size)
    assert relative_error(np.asarray(y)[rows], reference_tail(config, sample)) <= TOLERANCE[config.dtype]
