"""Deviceless GPU topologies: meshes of GPUs that are not present, for compiling the real GPU schedule.

``jax.experimental.topologies.get_topology_desc`` builds the devices of a GPU topology from an XLA
``TargetConfig`` record; a program lowered on a mesh of them compiles with that GPU's XLA pipeline
(fusion, GEMM rewriting, async collectives, the latency hiding scheduler) but cannot run. The
package ships records for 8-GPU nodes:

=========  ========  ============================================================================
name       platform  needs
=========  ========  ============================================================================
h100       cuda      the ``[aot]`` extra: jax-cuda13-plugin and -pjrt of the installed jax version
h200       cuda      the same (no NVIDIA libraries: compiling needs only the plugin)
mi300x     rocm      a loadable ROCm plugin, i.e. the ROCm runtime libraries: only on a ROCm host
mi355x     rocm      the same
=========  ========  ============================================================================

A topology is named ``<target>x<count>`` (``h100x8``, ``mi355xx8``; ``mi355x8`` reads the same).
The process must not have initialised a CUDA backend it cannot use: set ``JAX_PLATFORMS=cpu``
(or ``jax.config.update("jax_platforms", "cpu")``) on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re

import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh


class TopologyUnavailable(RuntimeError):
    """The compiler plugin for a deviceless topology cannot be loaded on this machine."""


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One shipped GPU target config: its name, XLA platform and the record file in the package."""

    name: str
    platform: str
    filename: str

    def config_text(self) -> str:
        """The ``TargetConfig`` record in text-proto form."""
        return importlib.resources.files("k3_tail.xla").joinpath("targets", self.filename).read_text()


GPU_TARGETS = {
    target.name: target
    for target in (
        GpuTarget("h100", "cuda", "h100.txtpb"),
        GpuTarget("h200", "cuda", "h200.txtpb"),
        GpuTarget("mi300x", "rocm", "mi300x.txtpb"),
        GpuTarget("mi355x", "rocm", "mi355x.txtpb"),
    )
}
_TOPOLOGY = re.compile(rf"^({'|'.join(sorted(GPU_TARGETS, key=len, reverse=True))})x?(\d+)$")


def parse_topology(topology: str) -> tuple[GpuTarget, int]:
    """``"h100x8"`` -> (the h100 target, 8); ValueError naming ``topology`` otherwise."""
    match = _TOPOLOGY.match(str(topology).strip().lower())
    if match is None or int(match.group(2)) < 1:
        raise ValueError(
            f"topology: expected <target>x<count> with target one of {sorted(GPU_TARGETS)} and count >= 1 "
            f"(e.g. 'h100x8'), got {topology!r}"
        )
    return GPU_TARGETS[match.group(1)], int(match.group(2))


def topology_mesh(topology: str, *, axis_name: str = "tp") -> Mesh:
    """A 1-d mesh with axis ``axis_name`` over the devices of a deviceless GPU topology.

    Programs lowered on it compile (``.lower(...).compile()``) but cannot execute. Raises
    TopologyUnavailable with the install hint when the platform's plugin cannot be loaded.
    """
    target, count = parse_topology(topology)
    try:
        description = topologies.get_topology_desc(
            f"k3_tail_{target.name}", target.platform, target_config=target.config_text(), topology=f"1x1x{count}"
        )
    except Exception as error:  # the plugin raises several types (ImportError, JaxRuntimeError, ...)
        raise TopologyUnavailable(
            f"cannot compile for {topology!r} here: {_unavailable_hint(target)} ({error})"
        ) from error
    return Mesh(np.array(description.devices), (axis_name,))


def _unavailable_hint(target: GpuTarget) -> str:
    if target.platform == "cuda":
        return "install the k3_tail[aot] extra (jax-cuda13-plugin and jax-cuda13-pjrt of the installed jax version)"
    return "the ROCm plugin needs the ROCm runtime libraries, so ROCm topologies compile only on a ROCm host"
