"""Measuring the tiers on this machine, loaded only when asked for: the benchmark
(:mod:`~k3_tail.tools.benchmark`: interleaved timing of the tiers, behind the ``bench`` and ``calibrate``
commands and :mod:`k3_tail.selection.table`'s measured tables) and its plots (:mod:`~k3_tail.tools.plotting`,
needs matplotlib)."""
