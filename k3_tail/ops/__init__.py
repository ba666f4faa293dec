"""The tiers' building blocks, below the config: plain values (dtypes, sizes, a SumPlan) in, never a TailConfig."""
