"""The names the tail puts into its programs: the ``jax.named_scope`` names of its collectives and its GEMM, and
the metadata key of its Pallas kernel's FLOPs.

XLA keeps a named scope in the ``op_name`` of every instruction traced inside it, through fusion and
scheduling (but for XLA's GPU all-reduce combiner, which drops the metadata of what it merges), so
:mod:`k3_tail.xla.report` finds the tail's parts by name in any program, a whole model's included. One
scope per role: ``latent_reduction`` (the routed latent's sum), ``shared_reduction`` (the shared
partials' sum, :func:`k3_tail.reduce_shared`'s and column_parallel's final all-reduce included),
``packed_reduction`` (one_shot's one all-reduce of both), ``output_gather`` (what assembles column
blocks or token rows), ``up_projection`` (the GEMM).
"""

from __future__ import annotations

PREFIX = "k3_tail/"
LATENT_REDUCTION = PREFIX + "latent_reduction"
SHARED_REDUCTION = PREFIX + "shared_reduction"
PACKED_REDUCTION = PREFIX + "packed_reduction"
OUTPUT_GATHER = PREFIX + "output_gather"
UP_PROJECTION = PREFIX + "up_projection"
SCOPES = (LATENT_REDUCTION, SHARED_REDUCTION, PACKED_REDUCTION, OUTPUT_GATHER, UP_PROJECTION)
# The metadata key under which one_kernel's Pallas kernel (ops/fused_projection.py) states its GEMM FLOPs in its
# custom call, which no HLO dot shows: k3_tail.xla.hlo_text reads it back.
GEMM_FLOPS_KEY = "k3_tail_gemm_flops"
