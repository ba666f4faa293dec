"""Pairwise covering designs: a small deterministic generator, and the designs of the tail's parity tests.

A pairwise (strength-2) covering design over factors F_1..F_n is a list of cases (one value per factor)
in which every *feasible* pair of values of any two factors appears together in at least one case.
Most defects are triggered by one value or by the interaction of two; covering every pair catches
them with a few dozen cases where the full product needs thousands.

Constraints are a predicate on a *partial* assignment (a dict holding only the factors assigned so
far): it returns False when the assignment breaks a rule, and True while it cannot tell yet. A pair
is feasible when some complete case that satisfies the predicate contains it.

The generator is greedy in the style of AETG (Cohen et al., 1997): each new case starts from an
uncovered pair, assigns the remaining factors one by one in a random order, each to the value that
covers the most still-uncovered pairs, and the best of a few such candidates is kept. A fixed seed
makes it deterministic (it never iterates a set or a hash-ordered collection), so every pytest-xdist
worker collects the same cases.

The generator does not use the library; the designs below take the tiers and their needs from its registry.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import k3_tail

Constraint = Callable[[Mapping[str, Any]], bool]
Exempt = Collection[tuple[str, str]]


def feasible_pairs(
    factors: Mapping[str, Sequence[Any]], constraint: Constraint | None = None, exempt: Exempt = ()
) -> list[tuple]:
    """Every feasible pair ((name_a, value_a), (name_b, value_b)), name_a before name_b in ``factors``, but those of
    the factor pairs in ``exempt``."""
    design = _Design(factors, constraint, exempt)
    return [design.named(pair) for pair in design.feasible_pairs()]


def uncovered_pairs(
    factors: Mapping[str, Sequence[Any]], cases: Sequence[Mapping[str, Any]], constraint: Constraint | None = None,
    exempt: Exempt = (),
) -> list[tuple]:
    """The feasible pairs (as :func:`feasible_pairs` names them) that no case in ``cases`` contains."""
    covered = {
        ((a, case[a]), (b, case[b])) for case in cases for a, b in itertools.combinations(list(factors), 2)
    }
    return [pair for pair in feasible_pairs(factors, constraint, exempt) if pair not in covered]


def pairwise_cases(
    factors: Mapping[str, Sequence[Any]],
    *,
    constraint: Constraint | None = None,
    seeds: Sequence[Mapping[str, Any]] = (),
    exempt: Exempt = (),
    seed: int = 0,
    candidates: int = 24,
) -> list[dict[str, Any]]:
    """A pairwise covering design over ``factors`` (name -> its values, hashable and distinct).

    Returns cases as dicts {name: value} in the order of ``factors``. Every case satisfies
    ``constraint`` (see the module docstring), every feasible pair of values of two factors appears
    in some case, and every partial assignment in ``seeds`` (a combination that must be tried
    together, e.g. a three-way interaction of interest) is contained in some case. The value pairs of a pair of
    factors in ``exempt`` (name, name) need not be covered (another design covers them).
    ``seed`` fixes the random choices: equal arguments give equal designs. ``candidates`` is how
    many candidate cases are built per accepted case (more: fewer cases, slower).
    Raises ValueError for an empty factor, repeated values, an unknown name or an infeasible seed.
    """
    design = _Design(factors, constraint, exempt)
    rng = random.Random(seed)
    uncovered = dict.fromkeys(design.feasible_pairs())
    rows: list[tuple[int, ...]] = []

    def accept(row):
        rows.append(row)
        for pair in design.pairs_of(row):
            uncovered.pop(pair, None)

    for partial in seeds:
        start = design.indices(partial)
        if not design.completable(start):
            raise ValueError(f"seeds: {dict(partial)!r} breaks the constraint")
        accept(design.best_of(start, uncovered, rng, candidates))
    while uncovered:
        starts = [next(iter(uncovered))] + [rng.choice(list(uncovered)) for _ in range(candidates - 1)]
        best = None
        for (a, value_a), (b, value_b) in starts:
            row = design.complete({a: value_a, b: value_b}, uncovered, rng)
            score = design.score(row, uncovered)
            if best is None or score > best[0]:
                best = (score, row)
        accept(best[1])
    return [design.as_dict(row) for row in design.without_redundant_rows(rows, seeds)]


class _Design:
    """Factors by position and values by index, so that pairs are tuples of ints: ((a, i), (b, j))."""

    def __init__(self, factors, constraint, exempt=()):
        self.names = list(factors)
        self.values = [tuple(factors[name]) for name in self.names]
        for name, values in zip(self.names, self.values, strict=True):
            if not values:
                raise ValueError(f"factors: {name!r} has no values")
            if len(set(values)) != len(values):
                raise ValueError(f"factors: {name!r} repeats a value: {values!r}")
        self.constraint = constraint
        self.exempt = {frozenset(map(self.position, pair)) for pair in exempt}
        self._completable = functools.lru_cache(maxsize=None)(self._completable_uncached)

    def named(self, pair):
        return tuple((self.names[f], self.values[f][i]) for f, i in pair)

    def position(self, name):
        if name not in self.names:
            raise ValueError(f"unknown factor {name!r}; the factors are {self.names}")
        return self.names.index(name)

    def indices(self, partial):
        """{factor position: value index} of a named partial assignment."""
        out = {}
        for name, value in partial.items():
            position = self.position(name)
            if value not in self.values[position]:
                raise ValueError(f"{value!r} is not a value of {name!r}: {self.values[position]!r}")
            out[position] = self.values[position].index(value)
        return out

    def as_dict(self, assignment):
        items = assignment.items() if isinstance(assignment, dict) else enumerate(assignment)
        return {self.names[f]: self.values[f][i] for f, i in sorted(items)}

    def completable(self, assignment):
        """Whether some complete case that satisfies the constraint extends ``assignment``."""
        return self._completable(tuple(assignment.get(f) for f in range(len(self.names))))

    def _completable_uncached(self, key):
        """``key``: each factor's value index, None where unset. Depth first over the first unset factor."""
        if self.constraint is not None and not self.constraint(
                {self.names[f]: self.values[f][i] for f, i in enumerate(key) if i is not None}):
            return False
        if None not in key:
            return True
        f = key.index(None)
        return any(self._completable((*key[:f], i, *key[f + 1:])) for i in range(len(self.values[f])))

    def feasible_pairs(self):
        return [
            ((a, i), (b, j))
            for a, b in itertools.combinations(range(len(self.names)), 2)
            if frozenset((a, b)) not in self.exempt
            for i in range(len(self.values[a]))
            for j in range(len(self.values[b]))
            if self.completable({a: i, b: j})
        ]

    def pairs_of(self, row):
        """The pairs ``row`` covers (none of an exempt pair of factors)."""
        return [((a, row[a]), (b, row[b])) for a, b in itertools.combinations(range(len(row)), 2)
                if frozenset((a, b)) not in self.exempt]

    def score(self, row, uncovered):
        return sum(pair in uncovered for pair in self.pairs_of(row))

    def complete(self, assignment, uncovered, rng):
        """``assignment`` extended to a whole row, greedily: each free factor (in a random order) takes
        the value that covers most uncovered pairs with the factors already set, ties broken at random."""
        assignment = dict(assignment)
        free = [f for f in range(len(self.names)) if f not in assignment]
        rng.shuffle(free)
        for f in free:
            options = []
            for i in range(len(self.values[f])):
                if not self.completable({**assignment, f: i}):
                    continue
                gain = sum(_pair(f, i, g, j) in uncovered for g, j in assignment.items())
                options.append((gain, rng.random(), i))
            assignment[f] = max(options)[2]  # never empty: the assignment was completable before
        return tuple(assignment[f] for f in range(len(self.names)))

    def best_of(self, assignment, uncovered, rng, candidates):
        rows = [self.complete(assignment, uncovered, rng) for _ in range(candidates)]
        return max(rows, key=lambda row: self.score(row, uncovered))  # max keeps the first of equals

    def without_redundant_rows(self, rows, seeds):
        """``rows`` less those (latest first) whose pairs and seeds the other rows all cover too."""
        seed_indices = [self.indices(partial) for partial in seeds]

        def contains(row, partial):
            return all(row[f] == i for f, i in partial.items())

        kept = list(rows)
        for row in reversed(rows):
            others = list(kept)
            others.remove(row)
            covered = {pair for other in others for pair in self.pairs_of(other)}
            if all(pair in covered for pair in self.pairs_of(row)) and all(
                any(contains(other, partial) for other in others) for partial in seed_indices if contains(row, partial)
            ):
                kept = others
        return kept


def _pair(a, i, b, j):
    """The pair of value i of factor a and value j of factor b, the earlier factor first."""
    return ((a, i), (b, j)) if a < b else ((b, j), (a, i))


# --- The tail's parity design -----------------------------------------------------------------------------

OVERLAP_TOKEN_THRESHOLD = 256  # TailConfig's default: above it the selected tier is column_parallel
LATENT_SIZE = 64
DIVISIBLE_HIDDEN_SIZE = 96  # divides by every TP size below: 1, 2, 3, 4, 8
INDIVISIBLE_HIDDEN_SIZE = 97  # prime: divides by none of 2, 3, 4, 8

# Every tier of the registry, and "selected": tier=None, the library picks (vLLM's rule: native at
# p = 1 or T = 0, overlap up to the threshold, column_parallel above it).
TIERS = (*(tier.value for tier in k3_tail.Tier), "selected")
TP_SIZES = (1, 2, 3, 4, 8)
# Token counts: empty; one token (fewer than the ranks: a one-row GEMM); a small odd prime (5: no p > 1
# divides it, so sequence-parallel output is padded, and p = 8 leaves ranks only padding rows); 24, which
# every p divides (sequence-parallel output stays token-sharded); 65 (odd, divisible by none of the p > 1:
# one row past two waves of 32); just above the overlap threshold (257, prime: the selected tier is
# column_parallel).
TOKEN_COUNTS = (0, 1, 5, 24, 65, OVERLAP_TOKEN_THRESHOLD + 1)
DTYPES = ("bfloat16", "float32")
WEIGHT_LAYOUTS = ("column", "replicated")
# The up projection's weights: in the activations' dtype (None) or quantised to an FP8 format.
UP_PROJ_DTYPES = (None, *k3_tail.ops.up_projection.FP8_FORMATS)
ALL_REDUCE_QUANTIZATIONS = (None, "int8", "int6", "int4")

TAIL_FACTORS = {
    "tier": TIERS,
    "tp_size": TP_SIZES,
    "num_tokens": TOKEN_COUNTS,
    "dtype": DTYPES,
    "weight_layout": WEIGHT_LAYOUTS,
    "hidden_divisible": (True, False),
    "routed_scaling_factor": (1.0, 2.0),
    "use_latent_norm": (True, False),
    "sequence_parallel": (False, True),
    "up_proj_dtype": UP_PROJ_DTYPES,
    "fp8_activations": (False, True),
    # The shared output reduced before the tail (k3_tail.reduce_shared) or summed by the tier.
    "shared_output_is_reduced": (False, True),
    # Sums in the dtype, or block-quantised with every codec (every buffer, whatever its size).
    "all_reduce_quantization": ALL_REDUCE_QUANTIZATIONS,
}


# (tier, layout) pairs a tier's record refuses, asked once: the generator asks the constraint ~10^5 times.
_REFUSED_LAYOUTS = frozenset((tier.value, layout) for tier in k3_tail.Tier for layout in WEIGHT_LAYOUTS
                             if tier.why_not(layout))


def tail_constraint(case: Mapping[str, Any]) -> bool:
    """A tier runs only where its record says it can (one_shot: the whole kernel; one_kernel: no FP8
    activations); every H divides by p = 1; FP8 activations need an FP8 kernel."""
    if (case.get("tier"), case.get("weight_layout")) in _REFUSED_LAYOUTS:
        return False
    if case.get("tp_size") == 1 and case.get("hidden_divisible") is False:
        return False
    if case.get("fp8_activations") is True and "up_proj_dtype" in case and case["up_proj_dtype"] is None:
        return False
    if case.get("fp8_activations") is True and case.get("tier") == k3_tail.Tier.ONE_KERNEL.value:
        return False
    return True


# Sequence-parallel output at every p > 1 both over T rows (T = 24) and over T rows padded to a multiple
# of p (T = 5): three-way interactions that pairs alone would not guarantee.
TAIL_SEEDS = tuple(
    {"tp_size": p, "num_tokens": num_tokens, "sequence_parallel": True}
    for num_tokens in (24, 5)
    for p in TP_SIZES
    if p > 1
)


@dataclasses.dataclass(frozen=True)
class TailCase:
    """One parity case: a tier (or "selected") run on p devices, checked against the float64 reference."""

    tier: str
    tp_size: int
    num_tokens: int
    dtype: str
    weight_layout: str
    hidden_divisible: bool
    routed_scaling_factor: float
    use_latent_norm: bool
    sequence_parallel: bool
    up_proj_dtype: str | None = None
    fp8_activations: bool = False
    shared_output_is_reduced: bool = False
    all_reduce_quantization: str | None = None

    @property
    def hidden_size(self) -> int:
        return DIVISIBLE_HIDDEN_SIZE if self.hidden_divisible else INDIVISIBLE_HIDDEN_SIZE

    @property
    def id(self) -> str:
        """E.g. ``overlap-p3-T5-bf16-column-H97-scale2-nonorm-sp-e4m3fnuz-fp8act-sharedreduced-int4``."""
        return "-".join((
            self.tier,
            f"p{self.tp_size}",
            f"T{self.num_tokens}",
            _DTYPE_IDS[self.dtype],
            self.weight_layout,
            f"H{self.hidden_size}",
            f"scale{self.routed_scaling_factor:g}",
            "norm" if self.use_latent_norm else "nonorm",
            "sp" if self.sequence_parallel else "nosp",
            "wdtype" if self.up_proj_dtype is None else self.up_proj_dtype.removeprefix("float8_"),
            *(("fp8act",) if self.fp8_activations else ()),
            *(("sharedreduced",) if self.shared_output_is_reduced else ()),
            *((self.all_reduce_quantization,) if self.all_reduce_quantization else ()),
        ))


@dataclasses.dataclass(frozen=True)
class ColumnCase:
    """One case of the column tier's contract: which columns each rank's buffer may write."""

    tp_size: int
    num_tokens: int
    dtype: str
    hidden_divisible: bool
    weight_layout: str

    @property
    def hidden_size(self) -> int:
        return DIVISIBLE_HIDDEN_SIZE if self.hidden_divisible else INDIVISIBLE_HIDDEN_SIZE

    @property
    def id(self) -> str:
        """E.g. ``p3-T13-bf16-H97-column``."""
        return f"p{self.tp_size}-T{self.num_tokens}-{_DTYPE_IDS[self.dtype]}-H{self.hidden_size}-{self.weight_layout}"


_DTYPE_IDS = {"bfloat16": "bf16", "float32": "f32"}

# The contract is about column blocks, so p > 1; T = 0 would leave the buffers empty.
COLUMN_FACTORS = {
    "tp_size": (2, 3, 4, 8),
    "num_tokens": (1, 13, OVERLAP_TOKEN_THRESHOLD + 1),
    "dtype": DTYPES,
    "hidden_divisible": (True, False),
    "weight_layout": WEIGHT_LAYOUTS,
}


def tail_cases() -> list[TailCase]:
    """The tail's parity design (deterministic: the same cases on every call and in every process)."""
    return [TailCase(**case) for case in pairwise_cases(TAIL_FACTORS, constraint=tail_constraint, seeds=TAIL_SEEDS)]


def column_cases() -> list[ColumnCase]:
    """The column contract's design."""
    return [ColumnCase(**case) for case in pairwise_cases(COLUMN_FACTORS)]


TAIL_CASES = tail_cases()
COLUMN_CASES = column_cases()
