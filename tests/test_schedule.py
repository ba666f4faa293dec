"""What XLA's GPU pipeline makes of every tier, at Kimi-K3 shapes on an 8-GPU mesh.

The meshes are deviceless topologies (``helpers.gpu_mesh_for``): 8 x H100 (XLA's CUDA pipeline; the
``[aot]`` extra), 8 x MI300X and, where the target matters (the FP8 formats, the one-token GEMMs and their
temporaries), 8 x MI355X (XLA's AMDGPU pipeline; the ``[rocm-aot]`` extra, which .ci/run's ROCm
environment has); each is skipped where it cannot compile. The MI355X params of the other tests are the
full cross (``slow``). Under scripts/rocm_check.sh the real ROCm mesh of the host joins them ("rocm").
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from helpers import compiled_tail, gpu_mesh_for, pairwise_params, tier_supports_layout, topology_params
from k3_tail import TailConfig, Tier, tail_forward
from k3_tail.ops.codecs import CODECS
from k3_tail.ops.up_projection import gemm_rows
from k3_tail.xla.compilation import compiler_options, tail_arguments
from k3_tail.xla.hlo_text import parse_module
from k3_tail.xla.report import report

CONFIG = TailConfig.kimi_k3()
L, H, P = CONFIG.latent_size, CONFIG.hidden_size, 8
TOKEN_COUNTS = [1, 16, 256]
LAYOUTS = ["column", "replicated"]


@pytest.fixture(scope="module", params=topology_params("h100x8", "mi300xx8", "mi355xx8", "rocm", slow=("mi355xx8",)))
def gpu_mesh(request):
    return gpu_mesh_for(request.param, P)


@pytest.fixture(scope="module", params=topology_params("h100x8", "mi300xx8", "mi355xx8", "rocm"))
def target_mesh(request):
    """For the tests where the GPU target matters: MI355X (gfx950) as well as MI300X (gfx942), always."""
    return gpu_mesh_for(request.param, P)


def compiled_report(mesh, tier, num_tokens, weight_layout):
    return report(compiled_tail(CONFIG, mesh, num_tokens, tier, weight_layout))


def elements(collective):
    return sum(array.elements for array in collective.arrays)


@pytest.mark.parametrize("weight_layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_overlap_tier_runs_the_shared_all_reduce_async_around_the_gemm(gpu_mesh, num_tokens, weight_layout):
    result = compiled_report(gpu_mesh, Tier.OVERLAP, num_tokens, weight_layout)
    shared = result.shared_reduction
    assert shared.kind == "all-reduce" and elements(shared) == num_tokens * H
    assert shared.is_async and shared.between_gemms
    assert result.overlapped is True


@pytest.mark.parametrize("weight_layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_overlap_tier_reduces_the_latent_before_the_gemm(gpu_mesh, num_tokens, weight_layout):
    result = compiled_report(gpu_mesh, Tier.OVERLAP, num_tokens, weight_layout)
    latent = [c for c in result.of_kind("all-reduce") if not c.carries_shared]
    assert [elements(c) for c in latent] == [num_tokens * L]
    assert latent[0].done < min(gemm.position for gemm in result.gemms)


def test_overlap_tier_overlaps_without_compiler_options(gpu_mesh):
    """The ordering barrier alone is enough for a program that is just the tail."""
    arguments = tail_arguments(CONFIG, gpu_mesh, 16)
    compiled = jax.jit(
        lambda *a: tail_forward(*a, config=CONFIG, mesh=gpu_mesh, tier="overlap")
    ).lower(*arguments).compile()
    assert report(compiled).overlapped is True


def test_native_tier_is_not_overlapped(gpu_mesh):
    """The verdict can be False: native's shared all-reduce waits for nothing to hide behind."""
    assert compiled_report(gpu_mesh, Tier.NATIVE, 16, "replicated").overlapped is False


def test_overlap_survives_two_chained_tails_in_one_program_with_the_library_options(gpu_mesh):
    arguments = tail_arguments(CONFIG, gpu_mesh, 16, weight_layout="column")

    def two_layers(routed, shared, norm_weight, kernel, routed_2, shared_2):
        forward = dict(config=CONFIG, mesh=gpu_mesh, tier="overlap", weight_layout="column")
        first = tail_forward(routed, shared, norm_weight, kernel, **forward)
        # The second layer's partials depend on the first layer's output, as in a model.
        second = tail_forward(routed_2 + first[None, :, :L], shared_2 + first[None], norm_weight, kernel, **forward)
        return first, second

    options = compiler_options(Tier.OVERLAP, gpu_mesh.devices.flat[0].platform)
    compiled = jax.jit(two_layers).lower(*arguments, arguments[0], arguments[1]).compile(compiler_options=options)
    assert report(compiled, shared_argument=1).overlapped is True
    assert report(compiled, shared_argument=5).overlapped is True


@pytest.mark.parametrize("weight_layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_column_tier_is_one_latent_and_one_hidden_all_reduce_around_a_local_gemm(gpu_mesh, num_tokens, weight_layout):
    result = compiled_report(gpu_mesh, Tier.COLUMN_PARALLEL, num_tokens, weight_layout)
    assert [(c.kind, elements(c)) for c in result.collectives] == [
        ("all-reduce", num_tokens * L), ("all-reduce", num_tokens * H)
    ]
    # The local GEMM is [T, L] x [L, H/p]: its FLOPs are exactly 2 * T * L * H/p (one row multiplied as two).
    assert result.gemm_flops == 2 * gemm_rows(num_tokens) * L * (H // P)


def test_column_tier_kernel_argument_is_the_local_block(gpu_mesh):
    compiled = compiled_tail(CONFIG, gpu_mesh, 16, Tier.COLUMN_PARALLEL, "column")
    entry = parse_module(compiled.as_text()).entry
    parameters = {i.operand_text: i for i in entry.instructions if i.opcode == "parameter"}
    assert parameters["3"].arrays[0].dims == (L, H // P)


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_scatter_gather_tier_is_a_latent_all_reduce_then_reduce_scatter_and_all_gather(gpu_mesh, num_tokens):
    result = compiled_report(gpu_mesh, Tier.SCATTER_GATHER, num_tokens, "column")
    assert [(c.kind, elements(c)) for c in result.collectives] == [
        ("all-reduce", num_tokens * L), ("reduce-scatter", num_tokens * H), ("all-gather", num_tokens * H)
    ]
    assert result.shared_reduction.kind == "reduce-scatter"
    assert result.gemm_flops == 2 * gemm_rows(num_tokens) * L * (H // P)


@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8"))
def test_library_options_override_user_xla_flags_that_make_all_reduce_synchronous(topology):
    gpu_mesh_for(topology)  # skips here when the topology cannot compile (and builds ROCm's stand-ins once)
    script = (
        "import jax, json, sys; jax.config.update('jax_platforms', 'cpu');"
        "from k3_tail import TailConfig, compile_tail, tail_forward, topology_mesh;"
        "from k3_tail.xla.compilation import tail_arguments; from k3_tail.xla.report import report;"
        "mesh = topology_mesh(sys.argv[1]); config = TailConfig.kimi_k3();"
        "plain = jax.jit(lambda *a: tail_forward(*a, config=config, mesh=mesh, tier='overlap'))"
        ".lower(*tail_arguments(config, mesh, 16)).compile();"
        "print(json.dumps([report(plain).overlapped,"
        " report(compile_tail(config, mesh, 16, tier='overlap')).overlapped]))"
    )
    environment = dict(os.environ, XLA_FLAGS="--xla_gpu_disable_async_collectives=ALLREDUCE", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script, topology], capture_output=True, text=True,
                            env=environment, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    without_options, with_options = json.loads(result.stdout.splitlines()[-1])
    assert (without_options, with_options) == (False, True)


PREFILL_TOKENS = 2048


def prefill_compile(mesh, tier, weight_layout, sequence_parallel):
    config = TailConfig.kimi_k3(sequence_parallel=sequence_parallel)
    return compiled_tail(config, mesh, PREFILL_TOKENS, tier, weight_layout)


def prefill_report(mesh, tier, weight_layout, sequence_parallel):
    return report(prefill_compile(mesh, tier, weight_layout, sequence_parallel))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated_output", "token_sharded_output"])
def test_token_parallel_tier_reduce_scatters_over_tokens_and_never_all_reduces(gpu_mesh, sequence_parallel):
    result = prefill_report(gpu_mesh, Tier.TOKEN_PARALLEL, "replicated", sequence_parallel)
    assert not result.of_kind("all-reduce")
    scattered = sorted(array.dims for c in result.of_kind("reduce-scatter") for array in c.arrays)
    assert scattered == [(PREFILL_TOKENS, L), (PREFILL_TOKENS, H)]  # XLA may combine the two into one
    gathered = [array.dims for c in result.of_kind("all-gather") for array in c.arrays]
    assert gathered == ([] if sequence_parallel else [(PREFILL_TOKENS, H)])


def test_token_parallel_tier_projects_its_own_rows_with_the_whole_kernel(gpu_mesh):
    """One GEMM producing this rank's [T/p, H] rows: the column tier's FLOPs, on the whole kernel."""
    compiled = prefill_compile(gpu_mesh, Tier.TOKEN_PARALLEL, "replicated", True)
    result = report(compiled)
    symbols = parse_module(compiled.as_text()).entry.by_name()
    assert [symbols[gemm.name].arrays[0].dims for gemm in result.gemms] == [(PREFILL_TOKENS // P, H)]
    assert result.gemm_flops == 2 * (PREFILL_TOKENS // P) * L * H


@pytest.mark.parametrize(("sequence_parallel", "ratio"), [(False, (L + 2 * H) / (2 * L + 2 * H)),
                                                          (True, (L + H) / (2 * L + H))],
                         ids=["replicated_output", "token_sharded_output"])
def test_token_parallel_moves_a_sixth_or_a_quarter_fewer_wire_bytes_than_the_column_tier(gpu_mesh, sequence_parallel,
                                                                                          ratio):
    """Replicated output: RS + RS + AG against AR + AR (5/6); token-sharded: RS + RS against AR + RS (3/4)."""
    token_parallel = prefill_report(gpu_mesh, Tier.TOKEN_PARALLEL, "replicated", sequence_parallel)
    column = prefill_report(gpu_mesh, Tier.COLUMN_PARALLEL, "column", sequence_parallel)
    wire = [sum(c.wire_bytes for c in result.collectives) for result in (token_parallel, column)]
    assert wire[0] / wire[1] == pytest.approx(ratio, rel=1e-6)
    assert wire[0] / wire[1] <= (0.834 if not sequence_parallel else 0.75)


# --- FP8 up-projection weights ------------------------------------------------------------------------------

# Every (tier, layout) pair once, weight-only FP8 or FP8 activations, each kind at T = 1 or 16 (decode) and
# 2048 (prefill; FP8 activations are for large T) and on both layouts. The weight-only programs at T = 1 are those
# of the one-token test's FP8 cases below (compiled once: helpers.compiled_tail).
FP8_WEIGHT_ONLY_CASES = [
    (Tier.NATIVE, "replicated", 1), (Tier.OVERLAP, "column", 1), (Tier.COLUMN_PARALLEL, "replicated", 2048),
    (Tier.SCATTER_GATHER, "column", 1), (Tier.ONE_SHOT, "replicated", 16),
]
FP8_ACTIVATIONS_CASES = [
    (Tier.NATIVE, "column", 2048), (Tier.OVERLAP, "replicated", 16), (Tier.COLUMN_PARALLEL, "column", 16),
    (Tier.SCATTER_GATHER, "replicated", 2048), (Tier.TOKEN_PARALLEL, "replicated", 2048),
]


def fp8_params(cases):
    return [pytest.param(tier, layout, tokens, id=f"{tier.value}-{layout}-T{tokens}") for tier, layout, tokens in cases]


def fp8_format_for(mesh):
    """The FP8 format the mesh's GPUs multiply: E4M3FNUZ on MI300X / MI325X (gfx942), else OCP E4M3FN."""
    kind = mesh.devices.flat[0].device_kind
    return "float8_e4m3fnuz" if any(name in kind for name in ("MI300", "MI325")) else "float8_e4m3fn"


def fp8_program(mesh, tier, weight_layout, num_tokens, fp8_activations):
    config = TailConfig.kimi_k3(up_proj_dtype=fp8_format_for(mesh), fp8_activations=fp8_activations)
    compiled = compiled_tail(config, mesh, num_tokens, tier, weight_layout)
    return parse_module(compiled.as_text()), report(compiled)


def assert_kernel_reaches_gemms_only_as_fp8(module, result):
    """Follow the FP8 kernel parameter through the schedule: every instruction that reads it (or a value
    made from it) is a GEMM, or yields FP8 only (a bitcast, slice or transpose of the kernel): the
    program never holds the kernel in another dtype, and a GEMM reads it."""
    gemms = {gemm.name for gemm in result.gemms}
    kernel = {i.name for i in module.entry.instructions
              if i.opcode == "parameter" and all(a.dtype.startswith("f8") for a in i.arrays)}
    assert kernel, "no FP8 parameter in the program"
    readers = []
    for instruction in module.entry.instructions:
        if not kernel.intersection(instruction.operands):
            continue
        if instruction.name in gemms:
            readers.append(instruction.name)
        elif all(array.dtype.startswith("f8") for array in instruction.arrays):
            kernel.add(instruction.name)
        else:
            pytest.fail(f"the kernel leaves FP8 in a non-GEMM instruction: {instruction.name} {instruction.type_text}")
    assert readers, "no GEMM reads the FP8 kernel"


@pytest.mark.parametrize(("tier", "weight_layout", "num_tokens"), fp8_params(FP8_WEIGHT_ONLY_CASES))
def test_fp8_weights_are_read_by_the_gemm_without_a_copy_in_another_dtype(target_mesh, tier, weight_layout, num_tokens):
    module, result = fp8_program(target_mesh, tier, weight_layout, num_tokens, fp8_activations=False)
    assert_kernel_reaches_gemms_only_as_fp8(module, result)


@pytest.mark.parametrize(("tier", "weight_layout", "num_tokens"), fp8_params(FP8_ACTIVATIONS_CASES))
def test_fp8_activations_make_both_gemm_operands_fp8(target_mesh, tier, weight_layout, num_tokens):
    """The normalised latent is quantised before the GEMM, which then reads two FP8 operands (and at most
    float32 scales): no bf16 operand, and the kernel stays FP8."""
    module, result = fp8_program(target_mesh, tier, weight_layout, num_tokens, fp8_activations=True)
    assert_kernel_reaches_gemms_only_as_fp8(module, result)
    for gemm in result.gemms:
        fp8 = [t for t in gemm.operand_types if t.startswith("f8")]
        assert len(fp8) >= 2 and set(gemm.operand_types) <= {*fp8, "f32"}, (gemm.name, gemm.operand_types)


def test_fp8_weights_halve_the_kernel_bytes_each_device_holds(target_mesh):
    """Per device: the column block [L, H/p] in FP8 plus float32 scales, against bf16 (half, plus 4H/p). (The
    scatter_gather tier at T = 1: programs the tests above compile as well.)"""
    bf16 = report(compiled_tail(CONFIG, target_mesh, 1, Tier.SCATTER_GATHER, "column"))
    _, fp8 = fp8_program(target_mesh, Tier.SCATTER_GATHER, "column", 1, fp8_activations=False)
    assert sum(a.bytes for a in fp8.arguments) - sum(a.bytes for a in bf16.arguments) == -L * H // P + 4 * H // P


# --- One-row GEMMs at their bytes ---------------------------------------------------------------------------

# XLA fuses only a static slice of a parameter into a GEMM; a column tier's block of the whole (replicated)
# kernel sits at its rank's offset, a dynamic slice, which XLA copies out before the GEMM at every T
# (docs/design.md, "Two GEMM forms XLA is kept from"). There the temporary memory is that copy, [L, H/p], and
# little more.
COPIES_ITS_BLOCK = {(Tier.COLUMN_PARALLEL, "replicated"), (Tier.SCATTER_GATHER, "replicated")}
TEMPORARY_LIMIT_BYTES = 2e6


def temporary_limit(tier, weight_layout, up_proj_dtype):
    """2 MB, or for a tier that copies its block the block's bytes ([L, H/p], 1 byte per FP8 value) + 0.2 MB."""
    if (tier, weight_layout) not in COPIES_ITS_BLOCK:
        return TEMPORARY_LIMIT_BYTES
    return (1 if up_proj_dtype else 2) * L * H // P + 0.2e6


def one_token_case_id(values):
    tier, weight_layout, fp8 = values
    return f"{tier.value}-{weight_layout}-{'fp8' if fp8 else 'bf16'}"


# Every pair of tier, layout and kernel dtype (each tier with both kernels, each layout with both, every tier with
# each layout it runs); the whole product with ``pytest -m slow``.
ONE_TOKEN_CASES = pairwise_params({"tier": tuple(Tier), "weight_layout": tuple(LAYOUTS), "fp8": (False, True)},
                                  one_token_case_id, tier_supports_layout)


@pytest.mark.parametrize(("tier", "weight_layout", "fp8"), ONE_TOKEN_CASES)
def test_a_one_token_call_reads_its_kernel_once_without_a_kernel_sized_intermediate(target_mesh, tier, weight_layout,
                                                                                      fp8):
    """Per device: bytes accessed at T = 1 at most 1.15x those at T = 2, temporary memory at most 2 MB at both
    (a column tier on the replicated kernel: its block's copy), and the product is one GEMM, not a multiply
    and a reduce; with the kernel in bf16 and in the FP8 format the mesh's GPUs multiply."""
    up_proj_dtype = fp8_format_for(target_mesh) if fp8 else None
    config = TailConfig.kimi_k3(up_proj_dtype=up_proj_dtype)
    programs = {}
    for num_tokens in (1, 2):
        compiled = compiled_tail(config, target_mesh, num_tokens, tier, weight_layout)
        programs[num_tokens] = report(compiled), compiled.memory_analysis().temp_size_in_bytes
    (one, one_temporary), (two, two_temporary) = programs[1], programs[2]
    assert [gemm.scopes for gemm in one.gemms] == [("up_projection",)]
    assert one.bytes_accessed <= 1.15 * two.bytes_accessed
    assert max(one_temporary, two_temporary) <= temporary_limit(tier, weight_layout, up_proj_dtype)


# --- Quantised sums (vLLM ROCm's QuickReduce) -------------------------------------------------------------------


def quantised_report(mesh, codec, num_tokens, **overrides):
    config = TailConfig.kimi_k3(all_reduce_quantization=codec, **overrides)
    return report(compiled_tail(config, mesh, num_tokens, Tier.OVERLAP, "replicated"))


def wire_bytes(result):
    return sum(c.wire_bytes for c in result.collectives)


@pytest.mark.parametrize(("codec", "target"), [("int8", 0.57), ("int4", 0.32)])
def test_quantised_sums_carry_the_codecs_bits_and_scales_instead_of_bf16(gpu_mesh, codec, target):
    """Overlap, replicated kernel, T = 2048, every sum quantised: two shots of uint8 payload per sum, at most
    the target share of the unquantised program's ring wire bytes: b/16 + 1/32 of them (block bytes / 64)."""
    plain = compiled_report(gpu_mesh, Tier.OVERLAP, PREFILL_TOKENS, "replicated")
    quantised = quantised_report(gpu_mesh, codec, PREFILL_TOKENS, quantized_all_reduce_min_bytes=0)
    assert sorted(c.kind for c in quantised.collectives) == ["all-gather"] * 2 + ["all-to-all"] * 2
    assert {(c.quantization, c.payload_dtypes) for c in quantised.collectives} == {(codec, ("u8",))}
    ratio = wire_bytes(quantised) / wire_bytes(plain)
    assert ratio <= target
    assert ratio == pytest.approx(CODECS[codec].block_bytes / 64, rel=1e-3)


def test_the_quantised_shared_sums_second_shot_runs_beside_the_gemm(gpu_mesh):
    """With the overlap tier's options the shared sum's all-gather is not combined with the latent's."""
    quantised = quantised_report(gpu_mesh, "int4", PREFILL_TOKENS, quantized_all_reduce_min_bytes=0)
    gathers = [c for c in quantised.in_scope("shared_reduction") if c.kind == "all-gather"]
    assert len(gathers) == 1 and gathers[0].scopes == ("shared_reduction",)
    assert gathers[0].is_async and gathers[0].between_gemms


def test_at_decode_the_default_minimum_keeps_the_sums_unquantised(gpu_mesh):
    """T = 16: the 0.1 and 0.2 MB sums are below vLLM's 2 MiB INT4 minimum for TP8."""
    plain = compiled_report(gpu_mesh, Tier.OVERLAP, 16, "replicated")
    quantised = quantised_report(gpu_mesh, "int4", 16)
    assert [(c.kind, c.arrays, c.quantization) for c in quantised.collectives] == [
        (c.kind, c.arrays, None) for c in plain.collectives]
