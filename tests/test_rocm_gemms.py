"""What ROCm's GEMMs need from the tail: FP8 activations only in the format the GPU multiplies, and no GEMM
that accumulates into a C operand.

FP8. A GEMM of two FP8 operands in a format the GPU does not multiply natively (E4M3FN on MI300X, gfx942;
E4M3FNUZ on MI355X, gfx950, and on H100) compiles to a float16 x float16 dot: FP8 bytes at the f16 rate.
The tail refuses that combination where it is traced (``check_fp8_activations``, from the device kind and
the hardware presets' ``fp8_formats``); the CPU, which has no FP8 matrix units, takes both formats.

C operand. On XLA's library GEMM path (``xla_gpu_enable_triton_gemm=False``, which autotuning may choose
on a real GPU) XLA folds "dot + shared" into a hipBLASLt / cuBLASLt GEMM with beta = 1 whose output is
aliased to a float32 C operand: the form vLLM ROCm removed because hipBLASLt's C-accumulating GEMM
faulted at 23393-23405 rows (896 x 3584) and 2914-2925 rows (7168 x 3584). On ROCm the tiers keep the add
out of the GEMM (``up_projection.outside_gemm``); CUDA keeps the fused form, as the H100 programs show.

The compiled tests take their meshes from ``helpers.gpu_mesh_for`` (deviceless topologies; each skipped
where it cannot compile: the ROCm ones need the ``[rocm-aot]`` extra); the others run on the CPU.
"""

import dataclasses
import re
import types

import jax
import numpy as np
import pytest
from flax import nnx

import covering
import k3_tail
from helpers import gpu_mesh_for, make_tp_mesh, topology_params
from k3_tail.hardware import HARDWARE, device_platform, native_fp8_formats
from k3_tail.ops.up_projection import check_fp8_activations, native_fp8_format, outside_gemm
from k3_tail.xla.hlo_text import is_gemm_custom_call, parse_module

KIMI = k3_tail.TailConfig.kimi_k3()
P = 8
FN, FNUZ = "float8_e4m3fn", "float8_e4m3fnuz"
NATIVE = {"h100x8": FN, "mi300xx8": FNUZ, "mi355xx8": FN}
OTHER = {FN: FNUZ, FNUZ: FN}
LIBRARY_GEMMS = {"xla_gpu_enable_triton_gemm": False}
# The GEMMs at the row counts where hipBLASLt's C-accumulating GEMM faulted (TP8): the column tier's
# [23400, 3584] x [3584, 896] and the token-parallel tier's [2920, 3584] x [3584, 7168].
FAULT_CASES = [
    pytest.param("column_parallel", "column", 23400, id="column_parallel-column-23400"),
    pytest.param("column_parallel", "replicated", 23400, id="column_parallel-replicated-23400"),
    pytest.param("token_parallel", "replicated", 23360, id="token_parallel-23360"),
]


def fake_device(device_kind, platform="gpu", raw_platform=None, platform_version=""):
    """A stand-in for a jax.Device: what device_platform and the FP8 check read."""
    client = types.SimpleNamespace(platform_version=platform_version)
    if raw_platform is not None:
        client._raw_platform = raw_platform
    return types.SimpleNamespace(device_kind=device_kind, platform=platform, client=client)


MI300X, MI355X, H100 = fake_device("AMD MI300X"), fake_device("AMD MI355X"), fake_device("NVIDIA H100 80GB HBM3")


# --- The FP8 formats a device multiplies (no compile) -----------------------------------------------------------


@pytest.mark.parametrize(("device_kind", "preset"), [
    ("AMD MI300X", "mi300x"), ("AMD Instinct MI300X", "mi300x"), ("AMD Instinct MI325X", "mi300x"),
    ("AMD MI355X", "mi355x"), ("AMD Instinct MI355X", "mi355x"), ("NVIDIA H100 80GB HBM3", "h200"),
    ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", "h200"),
])
def test_a_device_kind_multiplies_the_fp8_formats_of_its_architectures_preset(device_kind, preset):
    assert native_fp8_formats(device_kind) == HARDWARE[preset].fp8_formats


@pytest.mark.parametrize("device_kind", ["cpu", "NVIDIA A100-SXM4-80GB", "AMD Instinct MI250X", ""])
def test_a_device_kind_of_no_known_architecture_has_no_fp8_formats(device_kind):
    assert native_fp8_formats(device_kind) is None


@pytest.mark.parametrize(("device", "platform"), [
    (fake_device("whatever", raw_platform="rocm"), "rocm"),
    (fake_device("whatever", platform_version="rocm 70000"), "rocm"),
    (fake_device("AMD Instinct MI300X"), "rocm"),
    (fake_device("whatever", raw_platform="cuda"), "cuda"),
    (fake_device("NVIDIA H200"), "cuda"),
    (fake_device("TFRT_CPU_0", platform="cpu"), "cpu"),
])
def test_device_platform_tells_rocm_from_cuda_where_jax_says_gpu(device, platform):
    assert device_platform(device) == platform


def test_device_platform_of_the_cpu_backend_is_cpu():
    assert device_platform(jax.devices("cpu")[0]) == "cpu"


@pytest.mark.parametrize(("device", "native"), [(MI300X, FNUZ), (MI355X, FN), (H100, FN)])
def test_fp8_activations_in_another_format_than_the_gpus_are_refused_naming_all_three(device, native):
    other = OTHER[native]
    with pytest.raises(ValueError, match="^config.up_proj_dtype: ") as error:
        check_fp8_activations(np.dtype(other), True, device)
    message = str(error.value)
    assert other in message and device.device_kind in message and f"multiplies {native} natively" in message
    check_fp8_activations(np.dtype(native), True, device)  # its own format is an FP8 GEMM there


@pytest.mark.parametrize("device", [MI300X, MI355X, H100, fake_device("NVIDIA A100-SXM4-80GB")])
@pytest.mark.parametrize("name", [FN, FNUZ])
def test_weight_only_fp8_takes_either_format_on_any_gpu(device, name):
    check_fp8_activations(np.dtype(name), False, device)


@pytest.mark.parametrize("name", [FN, FNUZ])
def test_the_cpu_takes_fp8_activations_in_either_format(name):
    """The CPU has no FP8 matrix units to miss (XLA:CPU computes the product in float32)."""
    check_fp8_activations(np.dtype(name), True, jax.devices("cpu")[0])


def test_fp8_activations_on_a_gpu_of_unknown_format_are_refused_naming_it():
    with pytest.raises(ValueError, match="^config.up_proj_dtype: .*'AMD Instinct MI250X'.*does not know"):
        check_fp8_activations(np.dtype(FN), True, fake_device("AMD Instinct MI250X"))


@pytest.mark.parametrize(("device", "native"), [(MI300X, FNUZ), (MI355X, FN), (H100, FN)])
def test_quantize_up_proj_picks_the_format_the_device_multiplies(device, native):
    kernel = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    assert native_fp8_format(device) == native
    assert k3_tail.quantize_up_proj(kernel, device=device).dtype.name == native


def test_quantize_up_proj_on_the_cpu_picks_ocp_e4m3fn_and_wants_a_format_or_a_device():
    kernel = np.ones((8, 6), np.float32)
    assert k3_tail.quantize_up_proj(kernel, device=jax.devices("cpu")[0]).dtype.name == FN
    with pytest.raises(ValueError, match="^dtype: .*neither"):
        k3_tail.quantize_up_proj(kernel)
    with pytest.raises(ValueError, match="^device: "):
        k3_tail.quantize_up_proj(kernel, FN, device=jax.devices("cpu")[0])
    with pytest.raises(ValueError, match="^device: .*MI250X"):
        k3_tail.quantize_up_proj(kernel, device=fake_device("AMD Instinct MI250X"))


def test_outside_gemm_is_a_barrier_on_rocm_only():
    x = jax.numpy.ones((2, 3), jax.numpy.float32)
    for platform in ("cuda", "cpu", "gpu", None):
        assert outside_gemm(x, platform=platform) is x
    assert "optimization_barrier" in str(jax.make_jaxpr(lambda v: outside_gemm(v, platform="rocm"))(x))


# --- FP8 activations in compiled programs --------------------------------------------------------------------


def gemm_operand_types(text):
    """The element types each GEMM of a compiled program multiplies: the operands of the dot inside a GEMM
    fusion (after any conversion the fusion does), or the first two operands of a GEMM library call."""
    module = parse_module(text)

    def dots(name):
        computation = module.computations.get(name)
        if computation is None:
            return []
        symbols = computation.by_name()
        found = [tuple(symbols[o].arrays[0].dtype for o in i.operands[:2])
                 for i in computation.instructions if i.opcode == "dot"]
        return found + [types for i in computation.instructions for called in i.called for types in dots(called)]

    symbols = module.entry.by_name()
    result = []
    for instruction in module.entry.instructions:
        if is_gemm_custom_call(instruction):
            result.append(tuple(symbols[o].arrays[0].dtype for o in instruction.operands[:2]))
        elif instruction.opcode == "fusion":
            result.extend(types for called in instruction.called for types in dots(called))
    return result


def lowered_tail(config, mesh, num_tokens, tier, weight_layout):
    arguments = k3_tail.xla.compilation.tail_arguments(config, mesh, num_tokens, weight_layout=weight_layout)
    return jax.jit(lambda *a: k3_tail.tail_forward(*a, config=config, mesh=mesh, tier=tier,
                                                   weight_layout=weight_layout)).lower(*arguments)


FP8_CASES = [pytest.param("native", "column", 2048, id="native-column-2048"),
             pytest.param("token_parallel", "replicated", 2048, id="token_parallel-2048")]


@pytest.mark.parametrize(("tier", "weight_layout", "num_tokens"), FP8_CASES)
@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8", "mi355xx8"))
def test_fp8_activations_in_the_gpus_format_compile_to_an_fp8_by_fp8_dot(topology, tier, weight_layout, num_tokens):
    mesh = gpu_mesh_for(topology, P)
    native = native_fp8_format(mesh.devices.flat[0])
    assert native == NATIVE[topology]
    config = dataclasses.replace(KIMI, up_proj_dtype=native, fp8_activations=True)
    options = k3_tail.xla.compilation.compiler_options(tier, mesh.devices.flat[0].platform)
    text = lowered_tail(config, mesh, num_tokens, tier, weight_layout).compile(compiler_options=options).as_text()
    dtype = {FN: "f8e4m3fn", FNUZ: "f8e4m3fnuz"}[native]
    assert gemm_operand_types(text) and set(gemm_operand_types(text)) == {(dtype, dtype)}


@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8", "mi355xx8"))
def test_fp8_activations_in_the_other_format_are_refused_where_the_tail_is_traced(topology):
    mesh = gpu_mesh_for(topology, P)
    device = mesh.devices.flat[0]
    other = OTHER[NATIVE[topology]]
    config = dataclasses.replace(KIMI, up_proj_dtype=other, fp8_activations=True)
    kind = re.escape(device.device_kind)
    pattern = f"^config.up_proj_dtype: {other} with fp8_activations=True, but the device '{kind}'"
    with pytest.raises(ValueError, match=pattern):
        lowered_tail(config, mesh, 256, "native", "column")
    with pytest.raises(ValueError, match=pattern):  # the module refuses it when it is built
        nnx.eval_shape(lambda: k3_tail.LatentMoETail(config, mesh, rngs=nnx.Rngs(0)))
    # Weight-only FP8 in that format still traces (it multiplies in bf16).
    lowered_tail(dataclasses.replace(config, fp8_activations=False), mesh, 256, "native", "column")


def test_the_cpu_mesh_runs_fp8_activations_in_either_format():
    mesh = make_tp_mesh(2)
    for name in (FN, FNUZ):
        config = k3_tail.TailConfig(hidden_size=16, latent_size=8, dtype=np.float32, up_proj_dtype=name,
                                    fp8_activations=True)
        kernel = k3_tail.quantize_up_proj(np.ones((8, 16), np.float32), name)
        y = k3_tail.tail_forward(np.ones((2, 3, 8), np.float32), np.zeros((2, 3, 16), np.float32),
                                 np.ones(8, np.float32), kernel, config=config, mesh=mesh, tier="native")
        assert y.shape == (3, 16) and bool(np.isfinite(np.asarray(y)).all())


# --- No GEMM accumulating into C on ROCm -------------------------------------------------------------------


def c_accumulating_gemms(text):
    """The GEMM library calls of a compiled program that accumulate into a C operand: beta != 0 in their
    backend config, or their output aliased to an operand (``output_to_operand_aliasing``)."""
    found = []
    for computation in parse_module(text).computations.values():
        for instruction in computation.instructions:
            if not is_gemm_custom_call(instruction):
                continue
            beta = re.search(r'"beta":\s*(-?[0-9.eE+-]+)', instruction.attributes)
            aliased = instruction.attribute("output_to_operand_aliasing") is not None
            if aliased or (beta is not None and float(beta.group(1)) != 0.0):
                found.append(f"{instruction.name} {instruction.type_text} beta={beta and beta.group(1)} "
                             f"aliased={aliased}")
    return found


def compiled_text(config, mesh, num_tokens, tier, weight_layout, *, library_gemms):
    options = dict(k3_tail.xla.compilation.compiler_options(tier, mesh.devices.flat[0].platform))
    if library_gemms:
        options.update(LIBRARY_GEMMS)
    return lowered_tail(config, mesh, num_tokens, tier, weight_layout).compile(compiler_options=options).as_text()


@pytest.mark.parametrize("library_gemms", [True, False], ids=["library-gemms", "triton-gemms"])
@pytest.mark.parametrize(("tier", "weight_layout", "num_tokens"), FAULT_CASES)
@pytest.mark.parametrize("topology", topology_params("mi300xx8", "mi355xx8"))
def test_no_rocm_gemm_accumulates_into_c_at_the_row_counts_where_hipblaslt_faulted(
        topology, tier, weight_layout, num_tokens, library_gemms):
    mesh = gpu_mesh_for(topology, P)
    config = dataclasses.replace(KIMI, sequence_parallel=tier == "token_parallel")
    text = compiled_text(config, mesh, num_tokens, tier, weight_layout, library_gemms=library_gemms)
    assert gemm_operand_types(text), "no GEMM in the program"
    assert c_accumulating_gemms(text) == []


@pytest.mark.parametrize(("tier", "weight_layout", "num_tokens"), FAULT_CASES)
@pytest.mark.parametrize("topology", topology_params("h100x8"))
def test_cuda_keeps_the_gemm_that_accumulates_the_shared_partial_into_c(topology, tier, weight_layout, num_tokens):
    """Documents CUDA's behaviour, which the tail leaves alone: on the library path XLA folds the add into a
    cuBLASLt GEMM with beta = 1 and its output aliased to the float32 C operand."""
    mesh = gpu_mesh_for(topology, P)
    config = dataclasses.replace(KIMI, sequence_parallel=tier == "token_parallel")
    found = c_accumulating_gemms(compiled_text(config, mesh, num_tokens, tier, weight_layout, library_gemms=True))
    assert len(found) == 1 and "beta=1" in found[0] and "aliased=True" in found[0] and "f32[" in found[0]


def case_config(*, shared="partials", sequence_parallel=False, kernel="bf16", native=FN):
    """Kimi-K3's config with a case's shared output, output sharding and kernel (FP8 in ``native``)."""
    return dataclasses.replace(
        KIMI, has_shared_experts=shared != "none", shared_output_is_reduced=shared == "reduced",
        sequence_parallel=sequence_parallel, up_proj_dtype=None if kernel == "bf16" else native,
        fp8_activations=kernel == "fp8-activations")


def gemm_cases():
    """A pairwise design over every (tier, layout) pair and the forms that change what meets the GEMM's
    result: the shared output (partials, reduced before the tail, none), token-sharded output, the kernel
    (bf16, FP8 weights, FP8 activations), T (one row, decode, prefill) and the GEMM path; every pair on the
    library path with shared partials and with a reduced shared output."""
    # Not one_kernel: its product is its own Pallas kernel's, accumulated in registers, no GEMM of XLA's to fold an
    # add into (its record's own_kernel).
    pairs = [(tier.value, layout) for tier in k3_tail.Tier for layout in k3_tail.ops.columns.WEIGHT_LAYOUTS
             if tier.supports(layout) and tier.record.own_kernel is None]
    factors = {"pair": pairs, "shared": ["partials", "reduced", "none"], "sequence_parallel": [False, True],
               "kernel": ["bf16", "fp8", "fp8-activations"], "num_tokens": [1, 16, 2048],
               "library_gemms": [True, False]}

    def feasible(case):
        pair, shared = case.get("pair"), case.get("shared")
        if pair is not None and shared is not None:
            tier = k3_tail.Tier(pair[0])
            try:
                tier.record.check_runs(pair[1], case_config(shared=shared))
            except ValueError:
                return False
        return True

    def name(case):
        output = "token-sharded" if case["sequence_parallel"] else "replicated-output"
        return (f"{'-'.join(case['pair'])}-shared-{case['shared']}-{output}-{case['kernel']}-T{case['num_tokens']}-"
                f"{'library' if case['library_gemms'] else 'triton'}")

    # The library path with each shared form that meets the GEMM's result, for every pair: the triples the fold needs.
    seeds = [{"pair": pair, "shared": shared, "library_gemms": True}
             for pair in pairs for shared in ("partials", "reduced") if feasible({"pair": pair, "shared": shared})]
    return [pytest.param(case, id=name(case))
            for case in covering.pairwise_cases(factors, constraint=feasible, seeds=seeds)]


@pytest.mark.parametrize("case", gemm_cases())
@pytest.mark.parametrize("topology", topology_params("mi300xx8", "mi355xx8", slow=("mi355xx8",)))
def test_no_rocm_gemm_accumulates_into_c_in_any_tier_and_form(topology, case):
    mesh = gpu_mesh_for(topology, P)
    tier, weight_layout = case["pair"]
    config = case_config(shared=case["shared"], sequence_parallel=case["sequence_parallel"], kernel=case["kernel"],
                            native=NATIVE[topology])
    text = compiled_text(config, mesh, case["num_tokens"], tier, weight_layout, library_gemms=case["library_gemms"])
    assert gemm_operand_types(text), "no GEMM in the program"
    assert c_accumulating_gemms(text) == []
