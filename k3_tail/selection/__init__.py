"""Which tier serves a call: ``TailConfig.selection_policy`` is vLLM's rules (the default), a measured table or the
cost model; :func:`~k3_tail.selection.rules.select_tier` asks it for a :class:`~k3_tail.TierDecision`."""
