"""The covering designs behind the parity tests: every feasible pair covered, no rule broken, deterministic."""

import dataclasses
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

import covering
import k3_tail
from covering import COLUMN_CASES, COLUMN_FACTORS, TAIL_CASES, TAIL_FACTORS, TAIL_SEEDS, pairwise_cases, tail_constraint

TOY_FACTORS = {"colour": ("red", "green", "blue"), "size": (1, 2), "shape": ("round", "square"), "lid": (False, True)}


def no_blue_square(case):
    """A toy rule: nothing is both blue and square (None when a factor is not assigned yet)."""
    return not (case.get("colour") == "blue" and case.get("shape") == "square")


def pairs_in(cases, factors):
    return {((a, case[a]), (b, case[b])) for case in cases for a, b in itertools.combinations(list(factors), 2)}


# --- The generator, on a toy design --------------------------------------------------------------------------


def test_toy_design_covers_every_pair_of_values():
    cases = pairwise_cases(TOY_FACTORS)
    expected = {
        ((a, x), (b, y))
        for a, b in itertools.combinations(list(TOY_FACTORS), 2)
        for x in TOY_FACTORS[a]
        for y in TOY_FACTORS[b]
    }
    assert pairs_in(cases, TOY_FACTORS) == expected
    assert covering.uncovered_pairs(TOY_FACTORS, cases) == []


def test_toy_design_is_far_smaller_than_the_product():
    """3 x 2 x 2 x 2 = 24 combinations; 6 cases are the least that pair 3 colours with 2 sizes."""
    assert 6 <= len(pairwise_cases(TOY_FACTORS)) <= 7


def test_toy_cases_assign_every_factor_one_of_its_values_in_factor_order():
    for case in pairwise_cases(TOY_FACTORS):
        assert list(case) == list(TOY_FACTORS)
        assert all(case[name] in values for name, values in TOY_FACTORS.items())


def test_toy_constraint_excludes_infeasible_pairs_and_covers_the_rest():
    cases = pairwise_cases(TOY_FACTORS, constraint=no_blue_square)
    assert all(no_blue_square(case) for case in cases)
    feasible = set(covering.feasible_pairs(TOY_FACTORS, no_blue_square))
    assert (("colour", "blue"), ("shape", "square")) not in feasible
    assert (("colour", "blue"), ("shape", "round")) in feasible
    assert pairs_in(cases, TOY_FACTORS) == feasible


def test_a_pair_that_no_complete_case_can_hold_is_infeasible():
    """Rules that only bite together with a third factor still make the pair infeasible."""

    def rule(case):  # red needs a lid, and a lid needs size 2: so red with size 1 cannot be completed
        return not (case.get("colour") == "red" and case.get("lid") is False) and not (
            case.get("lid") is True and case.get("size") == 1
        )

    feasible = covering.feasible_pairs(TOY_FACTORS, rule)
    assert (("colour", "red"), ("size", 1)) not in feasible
    cases = pairwise_cases(TOY_FACTORS, constraint=rule)
    assert all(rule(case) for case in cases)
    assert covering.uncovered_pairs(TOY_FACTORS, cases, rule) == []


def test_seeds_are_each_contained_in_some_case():
    seeds = [{"colour": "red", "size": 2, "lid": True}, {"colour": "green", "shape": "round", "lid": False}]
    cases = pairwise_cases(TOY_FACTORS, seeds=seeds)
    for seed in seeds:
        assert any(seed.items() <= case.items() for case in cases), seed
    assert covering.uncovered_pairs(TOY_FACTORS, cases) == []


def test_the_pairs_of_exempt_factors_need_not_be_covered_and_every_other_pair_is():
    """The colour paired by another design: the 2 x 2 pairs of the other factors need fewer than 3 colours x 2."""
    exempt = [("colour", "size"), ("colour", "shape"), ("colour", "lid")]
    cases = pairwise_cases(TOY_FACTORS, exempt=exempt)
    pairs = set(covering.feasible_pairs(TOY_FACTORS, exempt=exempt))
    assert not any("colour" in (a, b) for (a, _), (b, _) in pairs)
    assert pairs <= pairs_in(cases, TOY_FACTORS)
    assert len(cases) < 6


def test_an_infeasible_seed_or_a_bad_factor_is_refused():
    with pytest.raises(ValueError, match="breaks the constraint"):
        pairwise_cases(TOY_FACTORS, constraint=no_blue_square, seeds=[{"colour": "blue", "shape": "square"}])
    with pytest.raises(ValueError, match="unknown factor"):
        pairwise_cases(TOY_FACTORS, seeds=[{"weight": 3}])
    with pytest.raises(ValueError, match="unknown factor"):
        pairwise_cases(TOY_FACTORS, exempt=[("colour", "weight")])
    with pytest.raises(ValueError, match="no values"):
        pairwise_cases({"a": (), "b": (1, 2)})
    with pytest.raises(ValueError, match="repeats a value"):
        pairwise_cases({"a": (1, 1), "b": (1, 2)})


def test_the_generator_is_deterministic():
    assert pairwise_cases(TOY_FACTORS, constraint=no_blue_square) == pairwise_cases(
        TOY_FACTORS, constraint=no_blue_square
    )
    assert pairwise_cases(TAIL_FACTORS, constraint=tail_constraint, seeds=TAIL_SEEDS) == [
        dataclasses.asdict(case) for case in TAIL_CASES
    ]


def test_the_designs_do_not_depend_on_the_hash_seed():
    """pytest-xdist workers must collect the same cases, whatever their PYTHONHASHSEED (this process's
    is random unless set: a process with another seed must build the same designs)."""
    script = "import covering; print([c.id for c in covering.TAIL_CASES + covering.COLUMN_CASES])"
    expected = repr([case.id for case in TAIL_CASES + COLUMN_CASES])
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=Path(__file__).parent, env={**os.environ, "PYTHONHASHSEED": hash_seed},
        capture_output=True, text=True, check=True,
    )
    assert result.stdout.strip() == expected


# --- The tail's parity design ---------------------------------------------------------------------------------


def test_tail_design_covers_every_feasible_pair():
    assert covering.uncovered_pairs(TAIL_FACTORS, [dataclasses.asdict(c) for c in TAIL_CASES], tail_constraint) == []


def test_tail_design_breaks_no_constraint():
    for case in TAIL_CASES:
        assert case.tier == "selected" or k3_tail.Tier(case.tier).supports(case.weight_layout), case.id
        assert case.tp_size != 1 or case.hidden_divisible, case.id
        assert (case.hidden_size % case.tp_size == 0) == case.hidden_divisible, case.id


def test_tail_design_infeasible_pairs_are_exactly_the_constraints():
    feasible = set(covering.feasible_pairs(TAIL_FACTORS, tail_constraint))
    everything = set(covering.feasible_pairs(TAIL_FACTORS))
    whole_kernel_tiers = [tier.value for tier in k3_tail.Tier if tier.record.needs_whole_kernel]
    assert everything - feasible == {
        *((("tier", tier), ("weight_layout", "column")) for tier in whole_kernel_tiers),
        (("tp_size", 1), ("hidden_divisible", False)),
        (("up_proj_dtype", None), ("fp8_activations", True)),
        (("tier", k3_tail.Tier.ONE_KERNEL.value), ("fp8_activations", True)),
    }


def test_tail_design_tries_sequence_parallel_output_both_sharded_and_padded_at_every_p():
    for seed in TAIL_SEEDS:
        assert any(seed.items() <= dataclasses.asdict(case).items() for case in TAIL_CASES), seed


def test_tail_design_is_small_and_its_ids_are_unique():
    assert len(TAIL_CASES) <= 50
    assert len({case.id for case in TAIL_CASES}) == len(TAIL_CASES)


def test_tail_case_id_names_every_factor():
    case = covering.TailCase("overlap", 3, 5, "bfloat16", "column", False, 2.0, False, True, "float8_e4m3fnuz", True,
                             True)
    assert case.id == "overlap-p3-T5-bf16-column-H97-scale2-nonorm-sp-e4m3fnuz-fp8act-sharedreduced"
    assert case.hidden_size == 97


def test_column_design_covers_every_pair():
    assert covering.uncovered_pairs(COLUMN_FACTORS, [dataclasses.asdict(c) for c in COLUMN_CASES]) == []
    assert len({case.id for case in COLUMN_CASES}) == len(COLUMN_CASES) <= 16
