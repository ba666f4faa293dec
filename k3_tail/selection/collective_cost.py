"""What one collective a tier issues costs per rank: the bytes it moves on a ring and its time on a GPU preset.

:class:`CollectiveCost` holds the collective's kind, its buffer as :mod:`k3_tail.xla.report` counts it (the
reduced buffer of an all-reduce, the input of a reduce-scatter, the gathered result of an all-gather, the
per-rank send buffer of an all-to-all) and its group of p ranks. Its per-rank ring wire bytes are
2(p-1)/p * B for an all-reduce and (p-1)/p * B for a reduce-scatter, all-gather or all-to-all, and its time an
alpha-beta model with the :class:`~k3_tail.hardware.Hardware` figures:

    collective = collective_latency_s + wire_bytes / link_bytes_per_s   (0 for a group of 1 rank)

A sum that travels quantised (``TailConfig.all_reduce_quantization``, inside its size window:
:mod:`k3_tail.ops.collectives`; ``CollectiveCost.codec``) moves its encoded chunks instead (b/16 +
1/32 of a bf16 buffer, padded to whole blocks), pays one latency per shot (two for an all-reduce,
one for a reduce-scatter) and adds the codec's memory passes at HBM bandwidth (encode, decode and
sum, and for an all-reduce re-encode and decode: 2B + 3Q + Q/p bytes for a buffer of B bytes whose
encoded size is Q).

``link_bytes_per_s`` is one GPU's bandwidth in one direction over all its links, and a ring collective is
assumed to drive it fully (AMD's fully connected xGMI node and NVSwitch both let every rank send to its peers
at that rate). What a tier's collectives add up to in a call is :mod:`k3_tail.selection.cost_model`'s.
"""

from __future__ import annotations

import dataclasses

from k3_tail.hardware import Hardware, hardware_preset
from k3_tail.ops.codecs import CODECS
from k3_tail.tiers.record import ALL_REDUCE, RING_WIRE_FACTORS, SUM_KINDS


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective a tier issues, per rank.

    kind: "all-reduce", "reduce-scatter", "all-gather" or "all-to-all". buffer_bytes: the buffer as
    :class:`k3_tail.xla.report.Collective` ``.bytes`` counts it (reduced buffer, reduce-scatter input,
    gathered result, all-to-all send buffer). group_size: ranks taking part (p). hidden: it runs
    beside the tier's GEMM instead of before or after it. codec: for a sum (all-reduce or
    reduce-scatter) that travels quantised (:mod:`k3_tail.ops.collectives`), the codec's name, else
    None; element_bytes: the bytes of one element of the buffer, from which the encoded size follows.
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
        """Bytes of the buffer as it travels: ``buffer_bytes``, or its p encoded chunks when quantised
        (each chunk 1/p of the elements rounded up, padded to whole blocks)."""
        if self.codec is None:
            return self.buffer_bytes
        chunk = -(-(self.buffer_bytes // self.element_bytes) // self.group_size)
        return self.group_size * CODECS[self.codec].encoded_bytes(chunk)

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends on a ring: 2(g-1)/g * B for an all-reduce, (g-1)/g * B otherwise, with B
        the payload (a quantised all-reduce's two shots move (g-1)/g of its encoded chunks each)."""
        return RING_WIRE_FACTORS[self.kind](self.group_size) * self.payload_bytes

    def seconds(self, hardware: Hardware | str) -> float:
        """collective_latency_s per collective (two for a quantised all-reduce) + wire_bytes /
        link_bytes_per_s + the codec's memory passes at HBM bandwidth on ``hardware``; 0 over a group
        of one rank.

        The codec's passes: encode (read B, write the payload Q), decode and sum the received chunks
        (read Q), then for an all-reduce re-encode the own chunk (write Q/p) and decode what the
        all-gather brought (read Q, write B); a reduce-scatter writes its B/p chunk.
        """
        hardware = hardware_preset(hardware)
        if self.group_size == 1:
            return 0.0
        wire = self.wire_bytes / hardware.link_bytes_per_s
        if self.codec is None:
            return hardware.collective_latency_s + wire
        buffer, payload, group = self.buffer_bytes, self.payload_bytes, self.group_size
        if self.kind == ALL_REDUCE:
            shots, passes = 2, 2 * buffer + 3 * payload + payload / group
        else:
            shots, passes = 1, buffer + buffer / group + 2 * payload
        return shots * hardware.collective_latency_s + wire + passes / hardware.hbm_bytes_per_s


def check_kind(kind: str) -> None:
    """Nothing, or ValueError unless ``kind`` is a collective's kind ("all-reduce", "reduce-scatter", ...)."""
    if kind not in RING_WIRE_FACTORS:
        raise ValueError(f"kind: expected one of {tuple(RING_WIRE_FACTORS)}, got {kind!r}")
