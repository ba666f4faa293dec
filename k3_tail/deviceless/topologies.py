"""Deviceless GPU topologies: meshes of GPUs that are not present, for compiling the real GPU schedule.

``jax.experimental.topologies.get_topology_desc`` builds the devices of a GPU topology from an XLA
``TargetConfig`` record; a program lowered on a mesh of them compiles with that GPU's XLA pipeline
(fusion, GEMM rewriting, async collectives, the latency hiding scheduler, code generation for the GPU)
but cannot run. The package ships records for 8-GPU nodes:

=========  ========  =====================  ===========================================================
name       platform  device kind            needs
=========  ========  =====================  ===========================================================
h100       cuda      NVIDIA H100 80GB HBM3  the ``[aot]`` extra: jax-cuda13-plugin and -pjrt of the
                                            installed jax version
h200       cuda      NVIDIA H200            the same (no NVIDIA libraries: compiling needs only the plugin)
mi300x     rocm      AMD MI300X             the ``[rocm-aot]`` extra (jax-rocm7-pjrt and -plugin of the
                                            installed jax), and gcc and readelf: without ROCm, stand-in
                                            runtime libraries are built on first use
                                            (``k3_tail.deviceless.rocm_stand_ins``); a ROCm host uses its own
mi355x     rocm      AMD MI355X             the same
=========  ========  =====================  ===========================================================

A topology is named ``<target>x<count>`` (``h100x8``, ``mi355xx8``; ``mi355x8`` reads the same).
The process must not have initialised a GPU backend it cannot use: set ``JAX_PLATFORMS=cpu`` on a
machine without a GPU. Without an AMD GPU a ROCm topology compiles XLA's whole AMDGPU pipeline without
autotuning (:mod:`k3_tail.deviceless.rocm_stand_ins`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re

import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

from k3_tail.deviceless import rocm_stand_ins


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
        return importlib.resources.files("k3_tail.deviceless").joinpath("targets", self.filename).read_text()


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
    """A 1-d mesh over the devices of a deviceless GPU topology.

    Programs lowered on it compile but cannot execute. The devices of one topology are made once per
    process, so meshes of the same topology compare equal. For a ROCm target on a machine without an
    AMD GPU the ROCm plugin is made to load first (:mod:`k3_tail.deviceless.rocm_stand_ins`).

    Args:
      topology: ``<target>x<count>`` with a target of :data:`GPU_TARGETS` ("h100x8", "mi355xx8").
      axis_name: the mesh's one axis.

    Returns:
      The ``jax.sharding.Mesh``.

    Raises:
      ValueError: naming ``topology`` when it is not such a name.
      TopologyUnavailable: naming what is missing to compile for it here and how to install it.
    """
    target, count = parse_topology(topology)
    return Mesh(np.array(_topology_devices(target, count)), (axis_name,))


@functools.cache
def _topology_devices(target: GpuTarget, count: int) -> tuple:
    topology = f"{target.name}x{count}"
    if target.platform == "rocm":
        try:
            rocm_stand_ins.ensure_rocm_plugin()
        except rocm_stand_ins.RocmUnavailable as error:
            raise TopologyUnavailable(f"cannot compile for {topology!r} here: {error}") from error
    try:
        description = topologies.get_topology_desc(
            f"k3_tail_{target.name}", target.platform, target_config=target.config_text(), topology=f"1x1x{count}"
        )
    except Exception as error:  # the plugin raises several types (ImportError, JaxRuntimeError, ...)
        raise TopologyUnavailable(
            f"cannot compile for {topology!r} here: {_unavailable_hint(target)} ({error})"
        ) from error
    return tuple(description.devices)


def _unavailable_hint(target: GpuTarget) -> str:
    if target.platform == "cuda":
        return "install the k3_tail[aot] extra (jax-cuda13-plugin and jax-cuda13-pjrt of the installed jax version)"
    return (f"the ROCm plugin did not load: {rocm_stand_ins.INSTALL_HINT}; on a ROCm host, the k3_tail[rocm] extra "
            "and the host's ROCm 7 runtime")
