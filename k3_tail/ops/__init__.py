"""The building blocks the tiers are made of, below the config: they take plain values (dtypes, sizes, a
:class:`~k3_tail.ops.collectives.SumPlan`), never a ``TailConfig``. Internal: the codecs and the forms of
a sum (:mod:`~k3_tail.ops.codecs`, :mod:`~k3_tail.ops.collectives`), the norm (:mod:`~k3_tail.ops.norm`),
column blocks (:mod:`~k3_tail.ops.columns`), token rows (:mod:`~k3_tail.ops.tokens`), the named scopes
(:mod:`~k3_tail.ops.scopes`), the up projection's GEMM and FP8 weights (:mod:`~k3_tail.ops.up_projection`),
one_kernel's Pallas kernel (:mod:`~k3_tail.ops.fused_projection`) and the filter that keeps jax's deprecation
warning of its backend out of users' programs (:mod:`~k3_tail.ops.pallas_triton`)."""
