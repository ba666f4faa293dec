"""Where a compiled latent MoE layer runs its shared reduction (found by its named scope), against the routed
experts' work (found by data flow: every instruction computed from a routed-expert weight that the schedule places
before the latent reduction starts). Positions are the entry computation's schedule order.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax

from k3_tail.xla import report as xla_report
from k3_tail.xla.hlo_text import parse_module

# Instructions that name or regroup values without computing.
_NO_COMPUTE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier"}


@dataclasses.dataclass(frozen=True)
class SharedReductionPlacement:
    """Schedule positions in one compiled layer: the shared reduction's ``start`` and ``done`` (equal when
    synchronous), the first instruction reading a routed-expert weight, the routed-expert instructions before the
    latent reduction's start (``routed_positions``, the last ``last_routed``)."""

    start: int
    done: int
    is_async: bool
    first_routed_read: int
    last_routed: int
    latent_reduction_start: int
    routed_positions: tuple[int, ...]

    @property
    def starts_before_the_routed_experts(self) -> bool:
        """The reduction is issued before any instruction reads a routed-expert weight."""
        return self.start < self.first_routed_read

    @property
    def ends_after_the_routed_experts(self) -> bool:
        """The reduction's wait comes after every routed-expert instruction that feeds the latent reduction."""
        return self.done > self.last_routed

    @property
    def routed_share_inside(self) -> float:
        """The share of the routed-expert instructions scheduled between the reduction's start and done."""
        inside = sum(self.start < position < self.done for position in self.routed_positions)
        return inside / len(self.routed_positions)


def shared_reduction_placement(compiled: jax.stages.Compiled,
                               routed_weights: Sequence[str]) -> SharedReductionPlacement:
    """The :class:`SharedReductionPlacement` of a compiled layer whose routed-expert weights are the
    parameters named ``routed_weights``; ValueError when the program has no shared reduction, latent
    reduction or routed-expert weight."""
    names = re.compile(r"\b(" + "|".join(map(re.escape, routed_weights)) + r")\b")
    report = xla_report.report(compiled, shared_argument=None)
    shared, latent = (next(iter(report.in_scope(scope)), None) for scope in ("shared_reduction", "latent_reduction"))
    if shared is None or latent is None:
        raise ValueError("compiled: expected a program with the tail's shared and latent reductions")
    schedule = parse_module(compiled.as_text()).entry.instructions
    derived = {i.name for i in schedule if i.opcode == "parameter" and names.search(i.op_name)}
    if not derived:
        raise ValueError("compiled: expected a program that reads routed-expert weights")
    weights, reads, routed = set(derived), [], []
    for position, instruction in enumerate(schedule):
        operands = set(instruction.operands)
        if not operands & derived:
            continue
        derived.add(instruction.name)
        if instruction.opcode in _NO_COMPUTE:
            if operands & weights and instruction.opcode in ("bitcast", "get-tuple-element"):
                weights.add(instruction.name)  # a view of a weight still is the weight
            continue
        if operands & weights:
            reads.append(position)
        if position < latent.start:
            routed.append(position)
    return SharedReductionPlacement(
        start=shared.start, done=shared.done, is_async=shared.is_async, first_routed_read=min(reads),
        last_routed=max(routed), latent_reduction_start=latent.start, routed_positions=tuple(routed),
    )
