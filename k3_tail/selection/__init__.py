"""Which tier serves a call: vLLM's rules (:mod:`~k3_tail.selection.rules`), a measured table
(:mod:`~k3_tail.selection.table`) or the cost model (:mod:`~k3_tail.selection.cost_model`, with the
GPU presets of :mod:`~k3_tail.hardware`); every choice is a
:class:`~k3_tail.selection.decision.TierDecision` with its reason."""
