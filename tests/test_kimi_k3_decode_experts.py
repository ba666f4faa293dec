"""The Kimi-K3 layer's decode on a GPU (k3_tail/models/kimi_k3/decode_experts.py and the packed input kernel).

The two Pallas kernels compute what XLA's gather method computes after the router's top-k (checked in interpret
mode on the CPU: the same kernels, programs in turn), and the whole layer's decode, compiled for deviceless
8 x H100, 8 x MI300X and 8 x MI355X, launches at most 8 GPU kernels besides its collectives and copies at T = 1
and 16, bf16 or MXFP4 experts (15 to 19 before the input kernel was packed and the experts moved into two
kernels), and accesses no more bytes per rank than it did then.

Tolerances, relative Frobenius error against the XLA route on the same inputs: float32 <= 1e-5 (the sums run in
another order, within float32 accumulation), bfloat16 <= 8e-3 (the same sums, each rounded once to bf16).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import gpu_mesh_for, topology_params
from k3_tail.models.kimi_k3 import LayerConfig, abstract_parameters, layer as layer_module, routed_experts
from k3_tail.models.kimi_k3.decode_experts import decode_experts
from k3_tail.models.kimi_k3.mxfp4_experts import Mxfp4Kernel, random_codes
from k3_tail.models.kimi_k3.per_rank import route_logits

EXPERTS, TOP_K, LATENT, WIDTH = 24, 4, 64, 64
TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 8e-3}
# The layer's decode before this change, per rank (kernels from XLA's dump; python -m k3_tail.models.kimi_k3.figures
# --topology T --tokens 1,16 at commit 49ae2d5): bytes accessed, which the packed layer may not exceed.
BYTES_BEFORE = {("h100x8", 1, None): 7_550_007_820, ("h100x8", 16, None): 7_576_115_724,
                ("h100x8", 1, "mxfp4"): 2_120_685_074, ("h100x8", 16, "mxfp4"): 2_142_263_826}
MAX_DECODE_KERNELS = {None: 8, "mxfp4": 10}


def experts(dtype, quantization, seed=0):
    """(products [T=3, W] float32, bias, gate, up, down): random, the products' logits in [0, E), z in [E, E + L)."""
    rng = np.random.default_rng(seed)

    def kernel(shape, fan_in):
        if quantization == "mxfp4":
            return Mxfp4Kernel(*map(jnp.asarray, random_codes(rng, shape, fan_in ** -0.5)))
        return jnp.asarray(rng.standard_normal(shape) * fan_in ** -0.5, dtype)

    products = jnp.asarray(rng.standard_normal((3, EXPERTS + LATENT + 10)), jnp.float32)
    bias = jnp.asarray(0.1 * rng.standard_normal(EXPERTS), jnp.float32)
    return (products, bias, kernel((EXPERTS, LATENT, WIDTH), LATENT), kernel((EXPERTS, LATENT, WIDTH), LATENT),
            kernel((EXPERTS, WIDTH, LATENT), WIDTH))


def in_kernels(products, bias, gate, up, down, dtype):
    return decode_experts(products, bias, gate, up, down, num_experts=EXPERTS, top_k=TOP_K, dtype=dtype,
                          interpret=True)


def in_xla(products, bias, gate, up, down, dtype):
    chosen, combine = route_logits(products[:, :EXPERTS], bias, top_k=TOP_K)
    latent = products[:, EXPERTS:EXPERTS + LATENT].astype(dtype)
    return routed_experts.experts_by_gather(latent, chosen, combine, gate, up, down).astype(dtype)


def relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@functools.cache
def kernels_on_experts(dtype, quantization):
    """``in_kernels`` of ``experts(dtype, quantization)`` (seed 0), interpreted once for the tests that read it."""
    return in_kernels(*experts(dtype, quantization), dtype)


@pytest.mark.parametrize(("dtype", "quantization"),
                         [(jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, "mxfp4")])
def test_the_two_kernels_compute_the_gather_method_after_the_routers_top_k(dtype, quantization):
    got = kernels_on_experts(dtype, quantization)
    assert got.shape == (3, LATENT) and got.dtype == dtype
    assert relative_error(got, in_xla(*experts(dtype, quantization), dtype)) <= TOLERANCE[np.dtype(dtype)]


@pytest.mark.parametrize("quantization", [None, "mxfp4"], ids=["bf16", "mxfp4"])
def test_a_stacks_layer_index_reads_that_layers_experts_where_they_lie(quantization):
    """Layer 1 of the stack holds seed 0's experts, layer 0 another draw's: index 1 computes what the unstacked
    seed-0 experts compute."""
    products, bias, *layer_1 = experts(jnp.bfloat16, quantization, seed=0)
    _, _, *layer_0 = experts(jnp.bfloat16, quantization, seed=1)
    stacked = [jax.tree.map(lambda *arrays: jnp.stack(arrays), one, other) for one, other in zip(layer_0, layer_1,
                                                                                                  strict=True)]
    got = decode_experts(products, bias, *stacked, num_experts=EXPERTS, top_k=TOP_K, dtype=jnp.bfloat16,
                         layer=jnp.int32(1), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(kernels_on_experts(jnp.bfloat16, quantization)))


def test_tied_scores_choose_the_lower_experts_as_top_k_does():
    products, bias, gate, up, down = experts(jnp.float32, None)
    tied = products.at[:, :EXPERTS].set(0.5)
    got = in_kernels(tied, jnp.zeros_like(bias), gate, up, down, jnp.float32)
    assert relative_error(got, in_xla(tied, jnp.zeros_like(bias), gate, up, down, jnp.float32)) <= 1e-5


def test_a_nan_logit_makes_its_tokens_row_nan_and_leaves_the_others_finite():
    products, *rest = experts(jnp.float32, None)
    got = np.asarray(in_kernels(products.at[1, 5].set(jnp.nan), *rest, jnp.float32))
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


# --- The compiled decode ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8", "mi355xx8"))
@pytest.mark.parametrize("num_tokens", [1, 16])
@pytest.mark.parametrize("quantization", [None, "mxfp4"], ids=["bf16", "mxfp4"])
def test_the_layers_decode_launches_at_most_8_gpu_kernels_besides_collectives(kimi_layer_figures, num_tokens, topology,
                                                                              quantization):
    assert kimi_layer_figures(topology, num_tokens, quantization).kernels <= MAX_DECODE_KERNELS[quantization]


@pytest.mark.parametrize("topology", topology_params("h100x8"))
@pytest.mark.parametrize("num_tokens", [1, 16])
@pytest.mark.parametrize("quantization", [None, "mxfp4"], ids=["bf16", "mxfp4"])
def test_the_layers_decode_accesses_no_more_bytes_than_before(kimi_layer_figures, num_tokens, topology, quantization):
    assert kimi_layer_figures(topology, num_tokens, quantization).bytes_accessed <= BYTES_BEFORE[topology, num_tokens,
                                                                                      quantization]


@pytest.mark.parametrize("topology", topology_params("h100x8"))
def test_a_decode_of_no_tokens_compiles_quietly_and_launches_no_expert_kernel(topology, recwarn):
    mesh = gpu_mesh_for(topology)
    config = LayerConfig.kimi_k3(num_experts=8, top_k=2, width_divisor=16)
    x = jax.ShapeDtypeStruct((0, config.hidden_size), config.dtype,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    text = layer_module.layer_forward.lower(abstract_parameters(config, mesh), x, config=config,
                                            mesh=mesh).as_text()
    assert "k3_tail_experts" not in text and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8"))
@pytest.mark.parametrize(("quantization", "width_divisor"), [(None, 16), ("mxfp4", 4)], ids=["bf16", "mxfp4"])
def test_the_decodes_gradient_lowers_for_the_gpu_with_the_two_kernels_in_its_forward(topology, quantization,
                                                                                    width_divisor):
    """The kernels are differentiated as XLA's route, their function, by a custom VJP (they have no rule)."""
    mesh = gpu_mesh_for(topology)
    config = LayerConfig.kimi_k3(num_experts=8, top_k=2, width_divisor=width_divisor,
                                 expert_quantization=quantization)
    x = jax.ShapeDtypeStruct((1, config.hidden_size), config.dtype,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def loss(parameters, x):
        return layer_module.layer_forward(parameters, x, config=config, mesh=mesh).astype(jnp.float32).sum()

    gradient = jax.jit(jax.grad(loss, argnums=1)).lower(abstract_parameters(config, mesh), x)
    assert gradient.out_info.shape == x.shape and "k3_tail_experts" in gradient.as_text()


def test_the_cpu_takes_xlas_gather_and_no_pallas_kernel():
    config = LayerConfig.kimi_k3(num_experts=8, top_k=2, width_divisor=16)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((1, config.hidden_size), config.dtype,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    text = layer_module.layer_forward.lower(abstract_parameters(config, mesh), x, config=config,
                                            mesh=mesh).as_text()
    assert "k3_tail_experts" not in text
