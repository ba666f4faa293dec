"""The tiers: per-rank functions that run inside ``jax.shard_map`` over the TP axis, one module each.

Each tier module holds its function and its :class:`~k3_tail.tiers.record.TierRecord`;
:mod:`~k3_tail.tiers.context` the call they all take (:class:`~k3_tail.tiers.context.TailCall`) and their
signature, and :mod:`~k3_tail.tiers.registry` lists the tiers, in order. They are built from the
blocks of :mod:`k3_tail.ops`.
"""
