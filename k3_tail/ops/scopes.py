"""The ``jax.named_scope`` names the tail puts on its collectives and its GEMM.

XLA keeps a named scope in the ``op_name`` metadata of every instruction traced inside it, through
fusion and scheduling, so :mod:`k3_tail.xla.report` finds the tail's parts by name in any compiled
program that contains it (a whole model's included), not by the size of their buffers. (One
exception: XLA's GPU all-reduce combiner drops the metadata of the all-reduces it merges.) Each
scope is one role:

- ``latent_reduction``: the sum of the routed latent partials (an all-reduce, or token_parallel's
  reduce-scatter over tokens);
- ``shared_reduction``: the sum of the shared-expert partials (the all-reduce or reduce-scatter that
  carries them, :func:`k3_tail.reduce_shared`'s included; column_parallel's final all-reduce, which
  also stitches the column blocks);
- ``packed_reduction``: one_shot's single all-reduce of the packed buffer, which carries both sums;
- ``output_gather``: the all-gather (or all-to-all) that assembles column blocks or token rows;
- ``up_projection``: the GEMM with the up-projection kernel.
"""

from __future__ import annotations

PREFIX = "k3_tail/"
LATENT_REDUCTION = PREFIX + "latent_reduction"
SHARED_REDUCTION = PREFIX + "shared_reduction"
PACKED_REDUCTION = PREFIX + "packed_reduction"
OUTPUT_GATHER = PREFIX + "output_gather"
UP_PROJECTION = PREFIX + "up_projection"
SCOPES = (LATENT_REDUCTION, SHARED_REDUCTION, PACKED_REDUCTION, OUTPUT_GATHER, UP_PROJECTION)
