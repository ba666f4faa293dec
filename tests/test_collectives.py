"""The form of a sum over the ranks: one all-reduce, or reduce-scatter + all-gather where measured faster."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import k3_tail
from helpers import make_tp_mesh, tier_layouts
from k3_tail.ops.collectives import ALL_REDUCE, SPLIT, SumPlan
from reference import TOLERANCE, make_inputs, reference_tail, relative_error

MIB = 2**20


@pytest.mark.parametrize(
    ("form", "platform", "dtype", "nbytes", "expected"),
    [
        ("auto", "cpu", jnp.bfloat16, 8 * MIB, SPLIT),
        ("auto", "cpu", jnp.bfloat16, 8 * MIB - 1, ALL_REDUCE),
        ("auto", "cpu", jnp.float32, 64 * MIB, ALL_REDUCE),
        ("auto", "gpu", jnp.bfloat16, 64 * MIB, ALL_REDUCE),
        ("auto", None, jnp.bfloat16, 64 * MIB, ALL_REDUCE),
        ("all-reduce", "cpu", jnp.bfloat16, 64 * MIB, ALL_REDUCE),
        ("reduce-scatter+all-gather", "gpu", jnp.float32, 1, SPLIT),
    ],
    ids=["cpu-bf16-large", "cpu-bf16-below", "cpu-f32", "gpu", "unknown-platform", "forced-all-reduce", "forced-split"],
)
def test_auto_splits_only_where_it_was_measured_faster(form, platform, dtype, nbytes, expected):
    assert SumPlan(form, platform).form_for(dtype, nbytes) == expected


# A [1024, 4096] bf16 shared sum is 8 MiB: split on CPU; the [1024, 64] latent stays one all-reduce.
LARGE = k3_tail.TailConfig(hidden_size=4096, latent_size=64)


def collective_kinds(config, tier, weight_layout="column"):
    compiled = k3_tail.compile_tail(config, make_tp_mesh(8), 1024, tier=tier, weight_layout=weight_layout)
    return [(c.kind, [a.dims for a in c.arrays]) for c in k3_tail.xla.report.report(compiled).collectives]


def test_on_cpu_a_large_bf16_sum_runs_as_reduce_scatter_and_all_gather():
    assert collective_kinds(LARGE, "column_parallel") == [
        ("all-reduce", [(1024, 64)]), ("reduce-scatter", [(1024, 4096)]), ("all-gather", [(1024, 4096)])]


def test_all_reduce_form_all_reduce_keeps_the_programs_of_before():
    config = dataclasses.replace(LARGE, all_reduce_form="all-reduce")
    assert collective_kinds(config, "column_parallel") == [("all-reduce", [(1024, 64)]), ("all-reduce", [(1024, 4096)])]


@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_every_tier_computes_the_tail_with_every_sum_split(tier, weight_layout):
    """The decomposition pads the rows to a multiple of p (T = 5 on 3 ranks) and slices them off."""
    config = k3_tail.TailConfig(hidden_size=97, latent_size=64, dtype=jnp.float32,
                                all_reduce_form="reduce-scatter+all-gather")
    inputs = make_inputs(config, 3, 5)
    y = k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=config,
                             mesh=make_tp_mesh(3), tier=tier, weight_layout=weight_layout)
    assert relative_error(y, reference_tail(config, inputs)) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize(("tier", "weight_layout"), tier_layouts())
def test_at_decode_sizes_auto_builds_the_program_of_before(tier, weight_layout):
    """Kimi-K3 at T = 16 on the CPU mesh: every sum is far below 8 MiB, so nothing changes for decode."""
    mesh = make_tp_mesh(8)

    def lowered(form):
        config = k3_tail.TailConfig.kimi_k3(all_reduce_form=form)
        arguments = k3_tail.xla.compilation.tail_arguments(config, mesh, 16, weight_layout=weight_layout)
        call = jax.jit(lambda *a: k3_tail.tail_forward(*a, config=config, mesh=mesh, tier=tier,
                                                       weight_layout=weight_layout))
        return call.lower(*arguments).as_text()

    assert lowered("auto") == lowered("all-reduce")
