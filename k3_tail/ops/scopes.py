"""The ``jax.named_scope`` names of the tail's collectives and GEMM, by which :mod:`k3_tail.xla.report` finds
them in any program (XLA keeps them in ``op_name`` through fusion, but for the GPU all-reduce combiner's merges),
and the metadata key of its Pallas kernel's FLOPs.
"""

from __future__ import annotations

PREFIX = "k3_tail/"
LATENT_REDUCTION = PREFIX + "latent_reduction"
SHARED_REDUCTION = PREFIX + "shared_reduction"
PACKED_REDUCTION = PREFIX + "packed_reduction"
OUTPUT_GATHER = PREFIX + "output_gather"
UP_PROJECTION = PREFIX + "up_projection"
SCOPES = (LATENT_REDUCTION, SHARED_REDUCTION, PACKED_REDUCTION, OUTPUT_GATHER, UP_PROJECTION)
# one_kernel's custom call states its GEMM FLOPs under this key, as no HLO dot shows them (k3_tail.xla.hlo_text).
GEMM_FLOPS_KEY = "k3_tail_gemm_flops"
