"""A token's routed output depends only on the experts it chose (k3_tail/models/kimi_k3/routed_experts.py).

One expert's weights made non-finite: in bf16 a NaN in its up kernel and an inf in its down kernel, in MXFP4 the
NaN scale (E8M0 u = 255) on one group of its gate kernel and one of its down kernel. Every method, both weight
formats, per rank under ``jax.shard_map`` on 2 CPU devices (L 32, m 64: each rank's m/p = 32 rows of the down
kernel one MXFP4 group), the ranks' partials summed: the rows that are not finite are exactly those of the tokens
that chose the expert (none when no token did). Routings: 13 tokens over experts 0-5 (C = 5 slots each, most of
them empty), and 40 tokens all on experts 3 and 5 (overflow rounds, whose unused chunks fall on the last expert).
The capacity method's empty slots multiply zero rows by every expert's weights; a zero combine weight there let
0 * NaN into the row the slot points at, so a NaN in an expert no token chose made other tokens NaN. The
"ragged_dot" method (by name only) is a known exception where jax lowers ``jax.lax.ragged_dot`` densely: a strict
expected failure.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import FAST_COMPILE_OPTIONS, make_tp_mesh, pairwise_params
from k3_tail.models.kimi_k3 import mxfp4_experts as mxfp4, routed_experts
from k3_tail.models.kimi_k3.mxfp4 import NAN_SCALE

LATENT, EXPERT_WIDTH, EXPERTS, TOP_K, TP_SIZE = 32, 64, 8, 2, 2
# Each routing, and the expert poisoned: (routing, expert) for one no token chose and one some tokens chose.
ROUTINGS = {"spread": (13, (7, 2)), "same-experts": (40, (7, 3))}


def routing(name):
    """(chosen [T, k], combine [T, k]): "spread", distinct experts among 0-5 per token; "same-experts", 3 and 5."""
    num_tokens, _ = ROUTINGS[name]
    rng = np.random.default_rng(num_tokens)
    if name == "spread":
        chosen = np.argsort(rng.random((num_tokens, 6)), axis=1)[:, :TOP_K]
    else:
        chosen = np.tile([3, 5], (num_tokens, 1))
    combine = rng.random((num_tokens, TOP_K)) + 0.5
    return chosen.astype(np.int32), (combine / combine.sum(axis=1, keepdims=True)).astype(np.float32)


def poisoned_kernels(weight_format, expert):
    """(gate, up, down) of EXPERTS experts, bf16 arrays or MXFP4 kernels, with ``expert``'s made non-finite."""
    rng = np.random.default_rng(0)
    shapes = ((EXPERTS, LATENT, EXPERT_WIDTH),) * 2 + ((EXPERTS, EXPERT_WIDTH, LATENT),)
    if weight_format == "bfloat16":
        gate, up, down = ((rng.standard_normal(shape) / np.sqrt(shape[1])).astype(jax.numpy.bfloat16)
                          for shape in shapes)
        up[expert, 0, 1], down[expert, 2, 3] = np.nan, np.inf
        return gate, up, down
    kernels = [mxfp4.random_codes(rng, shape, shape[1] ** -0.5) for shape in shapes]
    kernels[0][1][expert, 0, 1] = kernels[2][1][expert, 0, 3] = NAN_SCALE
    return tuple(mxfp4.Mxfp4Kernel(packed, scale) for packed, scale in kernels)


@functools.cache
def method_on_ranks(method):
    """``method`` per rank on TP_SIZE CPU devices, jitted: the ranks' partials summed, [T, L] float32."""
    experts = routed_experts.ROUTED_EXPERTS[method]

    def per_rank(latent, chosen, combine, gate, up, down):
        return jax.lax.psum(experts(latent, chosen, combine, gate, up, down), "tp")

    blocks = (P(None, None, "tp"), P(None, None, "tp"), P(None, "tp", None))
    mesh = make_tp_mesh(TP_SIZE, jax.sharding.AxisType.Auto)
    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(), P(), *blocks), out_specs=P()),
                   compiler_options=FAST_COMPILE_OPTIONS)


# A pairwise design (helpers.pairwise_params): every method meets both formats, both routings and both experts;
# ``pytest -m slow`` runs the rest of the product.
ISOLATION_FACTORS = {
    "method": tuple(routed_experts.ROUTED_EXPERTS),
    "weight_format": ("bfloat16", "mxfp4"),
    "routing_name": tuple(ROUTINGS),
    "chosen_by_some": (False, True),
}


def isolation_id(values):
    method, weight_format, routing_name, chosen_by_some = values
    expert = "expert-some-tokens-chose" if chosen_by_some else "expert-no-token-chose"
    return f"{method}-{weight_format}-{routing_name}-{expert}"


@pytest.mark.parametrize(tuple(ISOLATION_FACTORS), pairwise_params(ISOLATION_FACTORS, isolation_id))
def test_non_finite_weights_reach_exactly_the_tokens_routed_to_that_expert(method, weight_format, routing_name,
                                                                           chosen_by_some, request):
    expert = ROUTINGS[routing_name][1][chosen_by_some]
    chosen, combine = routing(routing_name)
    if method == "ragged_dot" and not (chosen == expert).any(axis=1).all():
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "jax.lax.ragged_dot's dense lowering (CPU, and XLA's default GPU pipeline) contracts every group's "
            "masked rows, zeros, with every expert's kernel: 0 * NaN reaches every token")))
    latent = np.random.default_rng(1).standard_normal((chosen.shape[0], LATENT)).astype(jax.numpy.bfloat16)
    routed = np.asarray(method_on_ranks(method)(latent, chosen, combine, *poisoned_kernels(weight_format, expert)))
    routed_to_expert = (chosen == expert).any(axis=1)
    assert routed_to_expert.any() == chosen_by_some
    np.testing.assert_array_equal(~np.isfinite(routed).all(axis=1), routed_to_expert)
