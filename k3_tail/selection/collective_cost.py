"""What one collective a tier issues costs per rank: the bytes it moves on a ring and its time on a GPU preset,
an alpha-beta model (buffers counted as :mod:`k3_tail.tiers.record` says):

    collective = collective_latency_s + wire_bytes / link_bytes_per_s   (0 for a group of 1 rank)

``link_bytes_per_s`` is one GPU's one-way bandwidth over all its links, which a ring is assumed to drive fully
(xGMI's fully connected node and NVSwitch both let every rank send to its peers at that rate).
"""

from __future__ import annotations

import dataclasses

from k3_tail.hardware import Hardware, hardware_preset
from k3_tail.ops.codecs import CODECS
from k3_tail.tiers.record import ALL_REDUCE, RING_WIRE_FACTORS, SUM_KINDS


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective a tier issues, per rank: its kind, its buffer as :class:`k3_tail.xla.report.Collective`
    counts it, its group of p ranks, whether it runs beside the GEMM (hidden), for a quantised sum the codec's
    name, and the bytes of one element (from which the encoded size follows). ValueError for a wrong field.
    """

    kind: str
    buffer_bytes: int
    group_size: int
    hidden: bool = False
    codec: str | None = None
    element_bytes: int = 2

    def __post_init__(self):
        check_kind(self.kind)
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size: expected an integer >= 1, got {self.group_size!r}")
        if self.codec is not None and (self.codec not in CODECS or self.kind not in SUM_KINDS):
            raise ValueError(f"codec: expected one of {tuple(CODECS)} on an all-reduce or reduce-scatter, got "
                             f"{self.codec!r} on a {self.kind}")

    @property
    def payload_bytes(self) -> int:
        """Bytes of the buffer as it travels: ``buffer_bytes``, or quantised its p encoded chunks (whole blocks)."""
        if self.codec is None:
            return self.buffer_bytes
        chunk = -(-(self.buffer_bytes // self.element_bytes) // self.group_size)
        return self.group_size * CODECS[self.codec].encoded_bytes(chunk)

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends on a ring: 2(g-1)/g of the payload for an all-reduce, (g-1)/g otherwise."""
        return RING_WIRE_FACTORS[self.kind](self.group_size) * self.payload_bytes

    def seconds(self, hardware: Hardware | str) -> float:
        """Seconds on ``hardware``: a latency per shot (two for a quantised all-reduce) + wire_bytes /
        link_bytes_per_s + the codec's memory passes at HBM bandwidth; 0 over a group of one rank."""
        hardware = hardware_preset(hardware)
        if self.group_size == 1:
            return 0.0
        wire = self.wire_bytes / hardware.link_bytes_per_s
        if self.codec is None:
            return hardware.collective_latency_s + wire
        buffer, payload, group = self.buffer_bytes, self.payload_bytes, self.group_size
        # Codec passes over B buffer and Q payload bytes: encode (B + Q), decode and sum (Q); an all-reduce
        # re-encodes its chunk (Q/p) and decodes the all-gather's (Q + B), a reduce-scatter writes its B/p.
        if self.kind == ALL_REDUCE:
            shots, passes = 2, 2 * buffer + 3 * payload + payload / group
        else:
            shots, passes = 1, buffer + buffer / group + 2 * payload
        return shots * hardware.collective_latency_s + wire + passes / hardware.hbm_bytes_per_s


def check_kind(kind: str) -> None:
    """ValueError unless ``kind`` is a collective's kind ("all-reduce", "reduce-scatter", ...)."""
    if kind not in RING_WIRE_FACTORS:
        raise ValueError(f"kind: expected one of {tuple(RING_WIRE_FACTORS)}, got {kind!r}")
