"""Every tier computes the tail's function: parity with the float64 reference, and the column contract.

The parity cases are a pairwise covering design (tests/covering.py): every pair of values of any two
of tier, p, T, dtype, weight layout, H % p, scale, norm and sequence-parallel output is run at least
once. The cases with sequence-parallel output are checked in tests/test_sequence_parallel.py, the full
Cartesian products in tests/test_exhaustive.py (``pytest -m slow``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from covering import COLUMN_CASES, DIVISIBLE_HIDDEN_SIZE, INDIVISIBLE_HIDDEN_SIZE, LATENT_SIZE, TAIL_CASES
from helpers import (
    assert_column_tier_writes_only_its_own_block,
    layout_for,
    make_tp_mesh,
    preferred_tier_layouts,
    run_case,
)
from reference import TOLERANCE, WRONG_TAILS, make_inputs, reference_tail, relative_error, tolerance

SMALL = k3_tail.TailConfig(hidden_size=DIVISIBLE_HIDDEN_SIZE, latent_size=LATENT_SIZE)
SMALL_ODD = dataclasses.replace(SMALL, hidden_size=INDIVISIBLE_HIDDEN_SIZE)
REPLICATED_OUTPUT_CASES = [case for case in TAIL_CASES if not case.sequence_parallel]


def run_tail(config, inputs, mesh, tier, weight_layout, **overrides):
    arrays = dict(
        routed_partials=inputs.routed,
        shared_partials=inputs.shared,
        norm_weight=inputs.norm_weight if config.use_latent_norm else None,
        up_proj_kernel=inputs.kernel,
    )
    arrays.update(overrides)
    return k3_tail.tail_forward(**arrays, config=config, mesh=mesh, tier=tier, weight_layout=weight_layout)


def assert_matches_reference(config, inputs, y, expected=None):
    expected = reference_tail(config, inputs) if expected is None else expected
    assert y.shape == expected.shape
    assert y.dtype == config.dtype
    assert relative_error(y, expected) <= TOLERANCE[config.dtype]


# --- Parity: the covering design -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", REPLICATED_OUTPUT_CASES, ids=lambda case: case.id)
def test_tier_matches_the_float64_reference_and_replicates_y(case):
    """y = RMSNorm_g(c * sum_i r_i) @ W + sum_i s_i within the dtype's tolerance, whole on every rank.

    An empty batch (T = 0) only has to come back as an empty [0, H] of the config's dtype.
    """
    config, inputs, y = run_case(case)
    assert y.shape == (case.num_tokens, case.hidden_size) and y.dtype == config.dtype
    if case.num_tokens:
        assert y.sharding.is_fully_replicated
        assert relative_error(y, reference_tail(config, inputs)) <= tolerance(config, inputs)


@pytest.mark.parametrize(
    ("use_latent_norm", "wrong_tail"),
    [
        pytest.param(use_latent_norm, wrong_tail, id=f"{'norm' if use_latent_norm else 'nonorm'}-{wrong_tail}")
        for use_latent_norm in (True, False)
        for wrong_tail in WRONG_TAILS
        # Under the norm the scale cancels (RMSNorm(c x) = RMSNorm(x) up to eps): nothing to detect.
        if not (use_latent_norm and wrong_tail == "unscaled")
    ],
)
def test_the_tolerance_detects_a_wrong_tail(use_latent_norm, wrong_tail):
    """The inputs make every term matter: a tail that drops one, or ignores the scale, fails the tolerance."""
    config = dataclasses.replace(SMALL, use_latent_norm=use_latent_norm, routed_scaling_factor=2.0)
    inputs = make_inputs(config, 8, 16)
    expected = reference_tail(config, inputs)
    wrong = reference_tail(*WRONG_TAILS[wrong_tail](config, inputs))
    assert relative_error(wrong, expected) > 10 * TOLERANCE[config.dtype]


# --- Optional inputs and placements --------------------------------------------------------------------------


@pytest.mark.parametrize(("tier", "weight_layout"), preferred_tier_layouts())
def test_tier_without_shared_experts_projects_the_latent_only(tier, weight_layout):
    """has_shared_experts=False: no shared partial is passed and y is the projected latent alone."""
    config = dataclasses.replace(SMALL_ODD, has_shared_experts=False)
    inputs = dataclasses.replace(make_inputs(config, 4, 5), shared=None)
    y = run_tail(config, inputs, make_tp_mesh(4), tier, weight_layout)
    assert_matches_reference(config, inputs, y)


REDUCED = dataclasses.replace(SMALL, routed_output_is_reduced=True)


@pytest.mark.parametrize("tier", [t for t in k3_tail.Tier if t.supports("column", REDUCED)], ids=lambda t: t.value)
def test_tier_with_an_already_reduced_routed_output_does_not_sum_it_again(tier):
    """routed_output_is_reduced: the [T, L] latent arrives reduced and must not be summed again."""
    config = REDUCED
    inputs = make_inputs(config, 4, 5)
    reduced = np.asarray(jnp.asarray(inputs.routed.astype(np.float32).sum(axis=0), config.dtype))
    y = run_tail(config, inputs, make_tp_mesh(4), tier, "column", routed_partials=reduced)
    expected = reference_tail(config, dataclasses.replace(inputs, routed=reduced[None]))
    assert_matches_reference(config, inputs, y, expected)


@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda t: t.value)
def test_tier_on_a_mesh_with_a_data_parallel_axis_replicates_over_it(tier):
    """Axes other than the TP axis replicate the computation; the result stays replicated."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    inputs = make_inputs(SMALL, 4, 16)
    y = run_tail(SMALL, inputs, mesh, tier, layout_for(tier))
    assert_matches_reference(SMALL, inputs, y)
    assert y.sharding.is_fully_replicated


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto], ids=str)
def test_inputs_in_any_sharding_are_placed(axis_type):
    """Inputs already on the mesh, sharded other than the tier wants, are re-placed, not rejected."""
    mesh = make_tp_mesh(8, axis_type)
    inputs = make_inputs(SMALL, 8, 16)
    on_mesh = dict(
        routed_partials=jax.device_put(inputs.routed, NamedSharding(mesh, P(None, "tp"))),
        shared_partials=jax.device_put(inputs.shared, NamedSharding(mesh, P(None, None, "tp"))),
        up_proj_kernel=jax.device_put(inputs.kernel, NamedSharding(mesh, P("tp"))),
    )
    y = run_tail(SMALL, inputs, mesh, k3_tail.Tier.COLUMN_PARALLEL, "column", **on_mesh)
    assert_matches_reference(SMALL, inputs, y)


@pytest.mark.parametrize("tier", list(k3_tail.Tier), ids=lambda t: t.value)
def test_tier_works_under_jit(tier):
    """tail_forward traced inside a caller's jax.jit computes the same y."""
    mesh = make_tp_mesh(8)
    inputs = make_inputs(SMALL, 8, 16)

    @jax.jit
    def layer(routed, shared, norm_weight, kernel):
        return k3_tail.tail_forward(routed, shared, norm_weight, kernel, config=SMALL, mesh=mesh, tier=tier) * 2

    y = layer(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel)
    assert_matches_reference(SMALL, inputs, y / 2)


def test_caller_arrays_are_not_modified():
    """No tier writes into or donates the caller's numpy or device arrays."""
    mesh = make_tp_mesh(8)
    inputs = make_inputs(SMALL, 8, 16)
    numpy_copies = {name: value.copy() for name, value in dataclasses.asdict(inputs).items()}
    shared_on_device = jnp.asarray(inputs.shared)
    for tier in k3_tail.Tier:
        run_tail(SMALL, inputs, mesh, tier, layout_for(tier), shared_partials=shared_on_device)
    for name, value in dataclasses.asdict(inputs).items():
        np.testing.assert_array_equal(value, numpy_copies[name], err_msg=name)
    assert not shared_on_device.is_deleted()
    np.testing.assert_array_equal(np.asarray(shared_on_device), numpy_copies["shared"])


# --- The column tier's contract: its own covering design ------------------------------------------------------


@pytest.mark.parametrize("case", COLUMN_CASES, ids=lambda case: case.id)
def test_column_tier_writes_only_its_own_block(case):
    """Rank k's buffer is s_k + latent @ W[:, block k] on block k, and bit-identical s_k elsewhere.

    Two ranks that swapped both weight block and write offset would still sum right; this would not.
    The cases pair every p (2, 3, 4, 8) with every T, dtype, H % p and weight layout.
    """
    config = dataclasses.replace(SMALL, hidden_size=case.hidden_size, dtype=jnp.dtype(case.dtype))
    assert_column_tier_writes_only_its_own_block(config, case.tp_size, case.num_tokens, case.weight_layout)


@pytest.mark.parametrize(("hidden_size", "tp_size", "argument"), [(5, -2, "tp_size"), (5, 0, "tp_size"),
                                                                  (0, 2, "hidden_size"), ("5", 2, "hidden_size")])
def test_padded_hidden_size_refuses_what_is_no_size_naming_it(hidden_size, tp_size, argument):
    with pytest.raises(ValueError, match=f"^{argument}: expected an integer >= 1"):
        k3_tail.padded_hidden_size(hidden_size, tp_size)
