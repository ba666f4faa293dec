"""The tiers: per-rank functions that run inside ``jax.shard_map`` over the TP axis, one module each, listed in
:mod:`~k3_tail.tiers.registry`."""
