"""Hardware presets for the cost model (one GPU's peak figures, each cited from its vendor's data sheet), the FP8
formats a device multiplies, and the checks of ``platform``, ``device`` and ``device_kind`` arguments. Data only:
no dependency on the rest of the library.
"""

from __future__ import annotations

import dataclasses
import math
import re
from types import MappingProxyType
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU of a TP group, for :func:`k3_tail.selection.cost_model.predict_time`; ValueError naming a bad field.

    Attributes:
      peak_flops, hbm_bytes_per_s: dense BF16 FLOP/s; HBM bandwidth.
      link_bytes_per_s: collective bandwidth, one direction, all links to its TP peers together.
      collective_latency_s: the fixed time of one collective.
      peak_fp8_flops, fp8_formats: dense FP8 FLOP/s of a GEMM of two FP8 operands in one of the FP8 dtype names
        its matrix units multiply natively; None and () without FP8 matrix units.
      platform: "cuda" or "rocm", whose kernel counts apply.
      kernel_launch_s: the time one more GPU kernel adds to a call (its launch and the gap to the next).
    """

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    collective_latency_s: float
    peak_fp8_flops: float | None = None
    fp8_formats: tuple[str, ...] = ()
    platform: str = "cuda"
    kernel_launch_s: float = 0.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        numbers = ("peak_flops", "hbm_bytes_per_s", "link_bytes_per_s", "collective_latency_s", "peak_fp8_flops",
                   "kernel_launch_s")
        for field in numbers:
            value = getattr(self, field)
            if field == "peak_fp8_flops" and value is None:
                continue
            zero_allowed = field in ("collective_latency_s", "kernel_launch_s")
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not is_number or value < 0 or (value == 0 and not zero_allowed):
                raise ValueError(f"{field}: expected a finite number {'>=' if zero_allowed else '>'} 0, got {value!r}")
        if not isinstance(self.fp8_formats, tuple) or not all(isinstance(f, str) for f in self.fp8_formats) \
                or bool(self.fp8_formats) != (self.peak_fp8_flops is not None):
            raise ValueError(
                f"fp8_formats: expected a tuple of FP8 dtype names, non-empty exactly when peak_fp8_flops is set, "
                f"got {self.fp8_formats!r}"
            )
        if self.platform not in GPU_VENDOR_PLATFORMS:
            raise ValueError(f"platform: expected one of {GPU_VENDOR_PLATFORMS}, got {self.platform!r}")


# Assumed, for every preset: no vendor publishes a per-collective latency. 10 us is the order of the
# small-message all-reduce times that nccl-tests / rccl-tests report inside one 8-GPU node.
_ASSUMED_COLLECTIVE_LATENCY_S = 10e-6
# Assumed too: 2 us for each GPU kernel of a call, what one kernel fewer saved in the one public measurement of the
# tail's kernels (tokenspeed, MI355X, one token: 17.56 us p50 against 19.76 us); a graph shortens launches, not gaps.
_ASSUMED_KERNEL_LAUNCH_S = 2e-6
# The XLA platforms of GPUs, one per vendor, as device_platform names them; with JAX's "gpu" for both.
GPU_VENDOR_PLATFORMS = ("cuda", "rocm")
GPU_PLATFORMS = (*GPU_VENDOR_PLATFORMS, "gpu")
# The platform names that selection and compilation take.
PLATFORMS = ("cpu", "gpu", "tpu", *GPU_VENDOR_PLATFORMS)

# Data sheets; link bandwidth per GPU per direction over all its links to its peers.
# mi300x: AMD Instinct MI300X (2023): BF16 1307.4 TFLOPs dense, FP8 2614.9; HBM3 5.3 TB/s; 7 xGMI links of 128 GB/s
#   bidirectional, one per peer: 7 x 64 = 448 GB/s. CDNA 3 (gfx942) multiplies the FNUZ FP8 formats.
# mi325x: AMD Instinct MI325X (2024): the MI300X's compute and links; HBM3E 6.0 TB/s.
# mi355x: AMD Instinct MI355X (2025): BF16 2.5 PFLOPs dense (256 CUs x 4096 FLOP/clock x 2.4 GHz = 2516.6 TFLOP/s),
#   FP8 twice that; HBM3E 8 TB/s; 7 links of 153.6 GB/s bidirectional: 537.6 GB/s. CDNA 4 (gfx950): OCP FP8.
# h200: NVIDIA H200 SXM (2024): BF16 1,979 TFLOPS with sparsity (989.4 dense, as H100 SXM's white paper), FP8 1978.9
#   dense; HBM3e 4.8 TB/s; NVLink 900 GB/s bidirectional: 450 GB/s; OCP FP8.
_PRESETS = (
    # name      BF16 FLOP/s  HBM bytes/s  link bytes/s  FP8 FLOP/s  FP8 formats multiplied natively  platform
    ("mi300x", 1307.4e12, 5.3e12, 448e9, 2614.9e12, ("float8_e4m3fnuz",), "rocm"),
    ("mi325x", 1307.4e12, 6.0e12, 448e9, 2614.9e12, ("float8_e4m3fnuz",), "rocm"),
    ("mi355x", 2516.6e12, 8.0e12, 537.6e9, 5033.2e12, ("float8_e4m3fn",), "rocm"),
    ("h200", 989.4e12, 4.8e12, 450e9, 1978.9e12, ("float8_e4m3fn",), "cuda"),
)
HARDWARE = MappingProxyType({
    name: Hardware(name, peak_flops=flops, hbm_bytes_per_s=hbm, link_bytes_per_s=link,
                   collective_latency_s=_ASSUMED_COLLECTIVE_LATENCY_S, peak_fp8_flops=fp8_flops, fp8_formats=formats,
                   platform=platform, kernel_launch_s=_ASSUMED_KERNEL_LAUNCH_S)
    for name, flops, hbm, link, fp8_flops, formats, platform in _PRESETS
})


# GPU architectures by the words of their device kinds ("AMD MI300X", "AMD Instinct MI300X", "NVIDIA H100 80GB
# HBM3"; case-insensitive), each with the preset whose matrix units (and ``fp8_formats``) it shares.
FP8_ARCHITECTURES = MappingProxyType({
    # CDNA 3 (gfx942): MI300X, MI300A, MI308X, MI325X multiply the FNUZ formats.
    ("mi300x", "mi300a", "mi308x", "mi325x"): "mi300x",
    # CDNA 4 (gfx950): MI350X and MI355X multiply the OCP formats.
    ("mi350x", "mi355x"): "mi355x",
    # Hopper (sm_90): H100, H800, H200, GH200 and H20 multiply the OCP formats.
    ("h100", "h800", "h200", "gh200", "h20"): "h200",
})


def architecture(device_kind: str) -> str | None:
    """The preset ("mi300x", "mi355x", "h200") whose matrix units a ``device_kind`` GPU shares, or None."""
    words = set(re.findall(r"[a-z0-9]+", str(device_kind).lower()))
    for names, preset in FP8_ARCHITECTURES.items():
        if words & set(names):
            return preset
    return None


def native_fp8_formats(device_kind: str) -> tuple[str, ...] | None:
    """The FP8 formats (dtype names) a ``device_kind`` GPU multiplies natively, or None when it is not known."""
    preset = architecture(device_kind)
    return None if preset is None else HARDWARE[preset].fp8_formats


def device_platform(device) -> str:
    """The platform a ``jax.Device`` compiles for: "rocm" or "cuda" for a GPU (both "gpu" to JAX), else its
    ``.platform``."""
    platform = getattr(device, "platform", None)
    if platform != "gpu":
        return platform
    client = getattr(device, "client", None)
    raw = getattr(client, "_raw_platform", None)  # "rocm" / "cuda" (JAX keeps the PJRT name here)
    if raw in ("rocm", "cuda"):
        return raw
    version = str(getattr(client, "platform_version", "")).lower()
    kind = str(getattr(device, "device_kind", "")).lower()
    if "rocm" in version or "hip" in version.split() or kind.startswith("amd"):
        return "rocm"
    if "cuda" in version or kind.startswith("nvidia"):
        return "cuda"
    return platform


def check_device(device: Any, argument: str = "device", *, optional: bool = False) -> jax.Device | None:
    """``device`` unchanged when it is a ``jax.Device`` or reads as one (a str ``platform`` and a non-empty str
    ``device_kind``), or None when ``optional``; ValueError naming ``argument`` for anything else (a platform's
    or a GPU's name says neither the device kind nor the backend)."""
    if device is None and optional:
        return None
    kind = getattr(device, "device_kind", None)
    if isinstance(device, jax.Device) or (isinstance(getattr(device, "platform", None), str)
                                          and isinstance(kind, str) and kind):
        return device
    none = " or None" if optional else ""
    raise ValueError(f"{argument}: expected a jax.Device (one of the mesh's: mesh.devices.flat[0]){none}, got "
                     f"{device!r}")


def check_device_kind(device_kind: Any, argument: str = "device_kind") -> str | None:
    """``device_kind`` unchanged when it is a non-empty str (``jax.Device.device_kind``: "NVIDIA H200", "cpu")
    or None (not known); ValueError naming ``argument`` otherwise."""
    if device_kind is None or (isinstance(device_kind, str) and device_kind):
        return device_kind
    raise ValueError(f"{argument}: expected a device kind (jax.Device.device_kind, a non-empty string) or None, "
                     f"got {device_kind!r}")


def check_platform(platform) -> str | None:
    """A name of :data:`PLATFORMS` or None as it is, a ``jax.Device``'s :func:`device_platform`; ValueError
    naming ``platform`` for anything else."""
    if isinstance(platform, jax.Device):
        return device_platform(platform)
    if platform is None or (isinstance(platform, str) and platform in PLATFORMS):
        return platform
    raise ValueError(f"platform: expected one of {PLATFORMS} (JAX's names and the GPU vendors'), a jax.Device "
                     f"or None, got {platform!r}")


def hardware_preset(hardware: Hardware | str) -> Hardware:
    """``hardware`` itself, or the preset of that name (case and surrounding blanks ignored)."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware.strip().lower() in HARDWARE:
        return HARDWARE[hardware.strip().lower()]
    raise ValueError(
        f"hardware: expected a k3_tail.selection.cost_model.Hardware or one of {sorted(HARDWARE)}, got {hardware!r}"
    )
