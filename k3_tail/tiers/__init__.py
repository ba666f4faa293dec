"""The tiers: per-rank functions that run inside ``jax.shard_map`` over the TP axis, one module each.

Each tier module holds its function and its :class:`~k3_tail.tiers.record.TierRecord`; the modules
beside them hold what the tiers share: the norm (:mod:`~k3_tail.ops.norm`), column blocks of the up
projection (:mod:`~k3_tail.ops.columns`) and token-sharded output (:mod:`~k3_tail.ops.tokens`).
:mod:`~k3_tail.tiers.registry` lists the tiers, in order.
"""
