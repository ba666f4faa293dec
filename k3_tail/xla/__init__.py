"""What XLA makes of the tail: ahead-of-time compilation with the library's options
(:mod:`~k3_tail.xla.compilation`), a reader of compiled HLO text (:mod:`~k3_tail.xla.hlo_text`), the GPU
kernels a compiled program launches, from XLA's dump (:mod:`~k3_tail.xla.launches`), and the report built on
them (:mod:`~k3_tail.xla.report`). The deviceless GPU topologies to compile for are
:mod:`k3_tail.deviceless`'s."""
