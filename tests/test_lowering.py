"""The tier of a call is the one for the platform its program is lowered for: exports and ahead-of-time lowerings
from this CPU host for ROCm and CUDA hold those platforms' tiers (Kimi-K3, p = 8), never the tracing host's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from helpers import make_tp_mesh, pairwise_params
from k3_tail.selection.lowering import LOWERING_PLATFORMS, per_lowering_platform

CONFIG = k3_tail.TailConfig.kimi_k3()
P_SIZE = 8
TRITON_CALL = "__gpu$xla.gpu.triton"
# Exporting a Pallas Triton call needs this check off: jax vouches for no compatibility of its target.
TRITON_EXPORT = dict(disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])
# What an interpreted Pallas kernel lowers to (its grid as loops): never in a GPU's program.
INTERPRETED_KERNEL = "stablehlo.while"


def model_call(mesh, weight_layout, tier=None):
    """A model's per-rank call of the tail, jitted over the mesh: routed [p*T, L] and shared [p*T, H] partials
    stacked by rank, the norm weight, the kernel in ``weight_layout`` and the ranks' indices."""
    def layer(routed, shared, norm_weight, kernel, rank):
        return k3_tail.latent_moe_tail(routed, shared, norm_weight, kernel, config=CONFIG, axis_name="tp",
                                       weight_layout=weight_layout, tier=tier, rank=rank)

    kernel_spec = P(None, "tp") if weight_layout == "column" else P()
    specs = (P("tp"), P("tp"), P(), kernel_spec, P("tp"))
    return jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=P())), specs


def abstract_arguments(mesh, specs, num_tokens, weight_layout):
    latent, hidden = CONFIG.latent_size, CONFIG.hidden_size
    width = k3_tail.padded_hidden_size(hidden, P_SIZE) if weight_layout == "column" else hidden
    shapes = [((P_SIZE * num_tokens, latent), CONFIG.dtype), ((P_SIZE * num_tokens, hidden), CONFIG.dtype),
              ((latent,), CONFIG.dtype), ((latent, width), CONFIG.dtype), ((P_SIZE,), jnp.int32)]
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
            for (shape, dtype), spec in zip(shapes, specs, strict=True)]


def target_mesh(platforms):
    """The mesh an export is traced over: abstract, naming the GPU its Triton kernels are lowered for (jax 0.12
    lowers one only for a GPU it is told of, on a host without one): MI300X's gfx942 where ROCm is a target."""
    kind = "gfx942" if "rocm" in platforms else "NVIDIA H100"
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    return jax.sharding.AbstractMesh((P_SIZE,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,),
                                     abstract_device=device)


def exported(platforms, num_tokens, weight_layout, tier=None):
    mesh = target_mesh(platforms)
    program, specs = model_call(mesh, weight_layout, tier)
    with jax.sharding.use_abstract_mesh(mesh):
        return export.export(program, platforms=platforms, **TRITON_EXPORT)(
            *abstract_arguments(mesh, specs, num_tokens, weight_layout))


def placed(mesh, num_tokens, arrays):
    """``arrays`` on the mesh in the column layout's shardings."""
    specs = model_call(mesh, "column")[1]
    return [jax.device_put(x, aval.sharding) for x, aval in
            zip(arrays, abstract_arguments(mesh, specs, num_tokens, "column"), strict=True)]


def selects_one_kernel(platform, num_tokens, weight_layout):
    decision = k3_tail.select_tier(CONFIG, num_tokens, P_SIZE, weight_layout=weight_layout, platform=platform)
    return decision.tier == k3_tail.Tier.ONE_KERNEL


@pytest.fixture(scope="module")
def mesh():
    return make_tp_mesh(P_SIZE)


LAYOUTS = ("column", "replicated")
TOKEN_COUNTS = (1, 16, 64, 1024)


def gpu_export_id(values):
    return "-".join(map(str, values))


# Every pair of GPU, T (one_kernel's, its limit and beyond) and layout; the whole product with ``pytest -m slow``.
GPU_EXPORTS = pairwise_params({"platform": ("rocm", "cuda"), "num_tokens": TOKEN_COUNTS, "weight_layout": LAYOUTS},
                              gpu_export_id)


@pytest.mark.parametrize(("platform", "num_tokens", "weight_layout"), GPU_EXPORTS)
def test_an_export_for_a_gpu_holds_that_gpus_tier(platform, num_tokens, weight_layout):
    module = exported((platform,), num_tokens, weight_layout).mlir_module()
    assert module.count(TRITON_CALL) == selects_one_kernel(platform, num_tokens, weight_layout)
    assert INTERPRETED_KERNEL not in module


@pytest.mark.parametrize("weight_layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_an_export_for_cpu_cuda_and_rocm_holds_each_platforms_tier(num_tokens, weight_layout):
    module = exported(("cpu", "cuda", "rocm"), num_tokens, weight_layout).mlir_module()
    gpus_with_the_kernel = sum(selects_one_kernel(gpu, num_tokens, weight_layout) for gpu in ("cuda", "rocm"))
    assert module.count(TRITON_CALL) == gpus_with_the_kernel  # one kernel in each such GPU's branch, none elsewhere
    assert INTERPRETED_KERNEL not in module


def test_a_forced_one_kernel_exports_the_compiled_kernel_for_a_gpu():
    module = exported(("rocm",), 64, "column", tier="one_kernel").mlir_module()
    assert module.count(TRITON_CALL) == 1
    assert INTERPRETED_KERNEL not in module


def test_a_multi_platform_export_runs_on_the_cpu_within_the_float64_reference(mesh):
    num_tokens, latent, hidden = 64, CONFIG.latent_size, CONFIG.hidden_size
    program = exported(("cpu", "cuda", "rocm"), num_tokens, "column")
    rng = np.random.default_rng(0)
    routed = rng.standard_normal((P_SIZE, num_tokens, latent))
    shared = rng.standard_normal((P_SIZE, num_tokens, hidden))
    norm_weight = 1 + 0.1 * rng.standard_normal(latent)
    kernel = rng.standard_normal((latent, hidden)) / latent**0.5
    values = [x.astype(CONFIG.dtype) for x in (routed, shared, norm_weight, kernel)]
    width = k3_tail.padded_hidden_size(hidden, P_SIZE)
    arguments = (values[0].reshape(-1, latent), values[1].reshape(-1, hidden), values[2],
                 np.pad(values[3], ((0, 0), (0, width - hidden))), np.arange(P_SIZE, dtype=np.int32))
    y = program.call(*placed(mesh, num_tokens, arguments))

    routed, shared, norm_weight, kernel = (x.astype(np.float64) for x in values)
    latent_sum = routed.sum(0) * CONFIG.routed_scaling_factor
    normed = latent_sum / np.sqrt((latent_sum**2).mean(-1, keepdims=True) + CONFIG.rms_norm_eps) * norm_weight
    want = normed @ kernel + shared.sum(0)
    assert np.linalg.norm(np.asarray(y, np.float64) - want) <= 1e-2 * np.linalg.norm(want)


@pytest.mark.xfail(strict=True, raises=jax.errors.JaxRuntimeError,
                   reason="XLA:CPU compiles every branch of a conditional whose branches hold collectives (XLA's "
                          "conditional simplifier keeps them), and it has no Triton: export decode programs for the "
                          "CPU and for the GPUs apart (docs/guide.md)")
def test_a_multi_platform_export_with_the_gpu_kernel_runs_on_the_cpu(mesh):
    program = exported(("cpu", "cuda", "rocm"), 1, "column")
    program.call(*placed(mesh, 1, [jnp.zeros(aval.shape, aval.dtype) for aval in program.in_avals]))


def test_a_given_device_is_the_override_whatever_the_lowering_platform(mesh):
    def layer(routed, shared, norm_weight, kernel):
        return k3_tail.latent_moe_tail(routed, shared, norm_weight, kernel, config=CONFIG, axis_name="tp",
                                       device=mesh.devices.flat[0])

    specs = (P("tp"), P("tp"), P(), P())
    program = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=P()))
    arguments = abstract_arguments(mesh, (*specs, P()), 1, "replicated")[:4]
    # The CPU device's tier at decode (no one_kernel) although ROCm's would be one_kernel.
    assert selects_one_kernel("rocm", 1, "replicated")
    assert TRITON_CALL not in export.export(program, platforms=("rocm",))(*arguments).mlir_module()


def test_platforms_whose_programs_agree_share_one_traced_branch():
    traced = []

    def run(branch, x):
        traced.append(branch)
        return x + len(branch)

    branches = {platform: "cpu" if platform == "cpu" else "gpu" for platform in LOWERING_PLATFORMS}
    program = jax.make_jaxpr(lambda x: per_lowering_platform(branches, run, x))
    assert "platform_index" in str(program(1.0)) and sorted(traced) == ["cpu", "gpu"]
    traced.clear()
    program = jax.make_jaxpr(lambda x: per_lowering_platform(dict.fromkeys(LOWERING_PLATFORMS, "any"), run, x))
    assert "platform_index" not in str(program(1.0)) and traced == ["any"]
    assert set(LOWERING_PLATFORMS) == {"cpu", "cuda", "rocm"}
