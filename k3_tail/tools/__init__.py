"""Tools around the library, loaded only when asked for: the benchmark (:mod:`~k3_tail.tools.benchmark`),
its plots (:mod:`~k3_tail.tools.plotting`, needs matplotlib) and the multi-process launcher helper
(:mod:`~k3_tail.tools.multiprocess`)."""
