"""Which tier serves a call: ``TailConfig.selection_policy`` (a :class:`k3_tail.policy.SelectionPolicy`) is
vLLM's rules (:class:`~k3_tail.selection.rules.VllmRules`, the default), a measured table
(:class:`~k3_tail.selection.table.SelectionTable`) or the cost model
(:class:`~k3_tail.selection.cost_model.CostModelPolicy`, with the GPU presets of :mod:`~k3_tail.hardware`);
:func:`~k3_tail.selection.rules.select_tier` asks it and returns a
:class:`~k3_tail.selection.decision.TierDecision`: the tier, its rule and the notes on the call."""
