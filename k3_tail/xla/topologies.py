"""Deprecated: the deviceless GPU topologies are :mod:`k3_tail.deviceless.topologies` (``k3_tail.topology_mesh``)."""

import warnings

from k3_tail.deviceless.topologies import GPU_TARGETS, GpuTarget, TopologyUnavailable, parse_topology, topology_mesh

__all__ = ["GPU_TARGETS", "GpuTarget", "TopologyUnavailable", "parse_topology", "topology_mesh"]

warnings.warn("k3_tail.xla.topologies is deprecated: import k3_tail.deviceless.topologies (or k3_tail.topology_mesh)",
              DeprecationWarning, stacklevel=2)
