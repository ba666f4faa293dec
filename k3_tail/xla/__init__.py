"""What XLA makes of the tail: ahead-of-time compilation with the library's options
(:mod:`~k3_tail.xla.compilation`), deviceless GPU topologies and their target configs
(:mod:`~k3_tail.xla.topologies`, ``targets/``), a reader of compiled HLO text
(:mod:`~k3_tail.xla.hlo_text`) and the report built on it (:mod:`~k3_tail.xla.report`)."""
