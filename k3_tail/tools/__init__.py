"""Tools around the library, loaded only when asked for: the benchmark (:mod:`~k3_tail.tools.benchmark`),
its plots (:mod:`~k3_tail.tools.plotting`, needs matplotlib), the multi-process launcher helper
(:mod:`~k3_tail.tools.multiprocess`), the experiments' harness (:mod:`~k3_tail.tools.experiment`) and its
tables (:mod:`~k3_tail.tools.tables`), the building blocks one at a time (:mod:`~k3_tail.tools.blocks`),
the float64 reference (:mod:`~k3_tail.tools.accuracy`) and the GPU
acceptance run of one_kernel's kernel (:mod:`~k3_tail.tools.acceptance`)."""
