"""The GPU acceptance run of one_kernel's kernel (scripts/gpu_acceptance.py): many back-to-back calls with
inputs that change every call, each checked against the split's oracle bit for bit and against the float32
reference within tolerance.

A case is a token count T and a kernel format at Kimi-K3's per-rank shapes of p = 8 (L 3584, H 7168, the
rank's [L, 896] column block, the [T, H] addend written into). A mode is how XLA runs
the program: "plain" (no command buffers) or "command_buffers" (the program captured as a CUDA/HIP graph).
Each call is one jitted program on every device of a 1-d mesh (``tp_mesh``): from its call index c (a device
scalar that the previous call returns: no host transfer between calls) and its device d it draws fresh inputs
on the device, takes rank (c + d) mod p, runs :func:`~k3_tail.ops.fused_projection.norm_project_add_into` with K
split over programs (its counters and scratch) and the oracle (``serial_split=True``: the same slabs summed in the
same order by one program per tile), and returns per device the count of output elements whose bits differ,
the relative error of the own columns against the reference and the count of non-finite outputs. The calls
are dispatched without waiting and read at the end, so that the GPU runs them back to back and each reuses
the memory (scratch, counters) of the one before.

On a CPU the kernel runs in Pallas's interpret mode, its programs in turn: the code is exercised, the split's
memory ordering is not, and there are no command buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail.cli.harness import AXIS_NAME, stepped
from k3_tail.cli.tables import format_table
from k3_tail.config import TailConfig
from k3_tail.hardware import GPU_PLATFORMS, device_platform, native_fp8_formats
from k3_tail.ops.columns import padded_hidden_size
from k3_tail.ops.fused_launch import TARGET_PROGRAMS, fused_grid, runs_interpreted_on
from k3_tail.ops.fused_projection import BlockProjection, norm_project_add_into, norm_project_add_into_reference
from k3_tail.ops.up_projection import quantize_up_proj
from k3_tail.tiers.registry import Tier
from k3_tail.xla.hlo_text import parse_module
from k3_tail.xla.launches import read_launches

TP_SIZE = 8
# A bf16 product rounds its operands to 2^-9 and the reference does not: about 3e-3 relative, as every tier's
# GEMM; the suite's kernel tests allow 1e-2 (an FP8 kernel's values are exact in bf16: the same).
RELATIVE_TOLERANCE = 1e-2
GPU_CALLS = 1250  # per case and mode: about 10^4 calls a device over Kimi-K3's 4 cases and 2 modes
CPU_CALLS = 2  # interpreted (one mode there): Kimi-K3's 4 cases' 8 calls cover every rank once
MODES = ("plain", "command_buffers")
# Per-executable XLA options of each mode on a GPU. An empty command-buffer set turns capture off; the program's
# command types (fusions, library GEMMs, Triton custom calls) captured from one command on make the whole call one
# graph (jax 0.10.2 and 0.12, CUDA and ROCm: its dump holds one kCommandBuffer thunk, checked at every compile).
# COLLECTIVES is never listed: on ROCm a collective captured in a graph is re-traced at every record (docs/guide.md,
# "ROCm graphs and collectives"; tests/test_command_buffers.py checks these programs hold none in a graph).
MODE_OPTIONS = {
    "plain": {"xla_gpu_enable_command_buffer": ""},
    "command_buffers": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL",
                        "xla_gpu_graph_min_graph_size": 1},
}
_DEFAULT_FP8_FORMAT = "float8_e4m3fn"  # for a device whose native format is not known: the kernel decodes either


@dataclasses.dataclass(frozen=True)
class Case:
    """T tokens with the kernel block in ``kernel_format``: the config's dtype or an FP8 format's name."""

    num_tokens: int
    kernel_format: str

    @property
    def name(self) -> str:
        return f"T{self.num_tokens}-{self.kernel_format}"


def kimi_k3_cases(config: TailConfig, device: jax.Device) -> tuple[Case, ...]:
    """T = 1, 16 and the tier's largest T (``one_kernel_max_tokens``) in the config's dtype, and T = 1, 16 with
    the kernel in ``device``'s native FP8 format (float8_e4m3fnuz on MI300X, float8_e4m3fn elsewhere)."""
    fp8 = (native_fp8_formats(device.device_kind) or (_DEFAULT_FP8_FORMAT,))[0]
    token_counts = sorted({1, 16, config.one_kernel_max_tokens})
    return (*(Case(t, config.dtype.name) for t in token_counts), Case(1, fp8), Case(16, fp8))


def serial_split_oracle(latent, norm_weight, kernel, addend, **arguments) -> jax.Array:
    """The kernel with the same grid's slabs summed in each tile's one program: the split's result bit for bit."""
    return norm_project_add_into(latent, norm_weight, kernel, addend, serial_split=True, **arguments)


Oracle = Callable[..., jax.Array]


def _block_width(config: TailConfig) -> int:
    """Hb: a rank's column block at p = :data:`TP_SIZE`."""
    return padded_hidden_size(config.hidden_size, TP_SIZE) // TP_SIZE


def random_inputs(key: jax.Array, case: Case, config: TailConfig):
    """(latent [T, L], norm weight [L], kernel block [L, Hb] (quantised for an FP8 case), addend [T, H]), drawn
    on the device. Each row of the latent is scaled by its own power of two in [2^-8, 2^8], so that the slabs'
    exponents differ between rows and calls."""
    latent_key, scale_key, weight_key, kernel_key, addend_key = jax.random.split(key, 5)
    rows, latent_size, dtype = case.num_tokens, config.latent_size, config.dtype
    block_width = _block_width(config)
    row_scale = jnp.exp2(jax.random.randint(scale_key, (rows, 1), -8, 9).astype(jnp.float32))
    latent = (jax.random.normal(latent_key, (rows, latent_size)) * row_scale).astype(dtype)
    norm_weight = (1 + 0.1 * jax.random.normal(weight_key, (latent_size,))).astype(dtype)
    kernel = (jax.random.normal(kernel_key, (latent_size, block_width)) / np.sqrt(latent_size)).astype(dtype)
    if case.kernel_format != dtype.name:
        kernel = quantize_up_proj(kernel, case.kernel_format)
    return latent, norm_weight, kernel, jax.random.normal(addend_key, (rows, config.hidden_size)).astype(dtype)


def check_call(call: jax.Array, *, case: Case, config: TailConfig, seed: int, platform: str, oracle: Oracle):
    """One checked call on this device (inside ``jax.shard_map`` over a mesh of axis AXIS_NAME; module docstring).

    Returns (mismatching elements int32 [1], relative error float32 [1], non-finite elements int32 [1], the next
    call index). Cost: the kernel twice (2*T*L*Hb FLOPs each), the reference (the same FLOPs in float32) and
    the inputs' T*(L+H) + L*Hb random values.
    """
    device = lax.axis_index(AXIS_NAME)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), call), device)
    rank = (call + device) % TP_SIZE
    latent, norm_weight, kernel, addend = random_inputs(key, case, config)
    block_width = _block_width(config)
    shape = dict(rank=rank.reshape(1).astype(jnp.int32),
                 projection=BlockProjection(tp_size=TP_SIZE, hidden_size=config.hidden_size, eps=config.rms_norm_eps,
                                            scale=config.routed_scaling_factor))
    # The GPU's grid (split K) in interpret mode too, whose own default is one program per tile.
    arguments = dict(shape, platform=platform, interpret=runs_interpreted_on(platform),
                     target_programs=TARGET_PROGRAMS)
    split = norm_project_add_into(latent, norm_weight, kernel, addend, **arguments)
    serial = oracle(latent, norm_weight, kernel, addend, **arguments)
    own = functools.partial(lax.dynamic_slice_in_dim, start_index=rank * block_width, slice_size=block_width, axis=1)
    want = own(norm_project_add_into_reference(latent, norm_weight, kernel, addend, **shape)).astype(jnp.float32)
    bits = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.uint16)
    mismatches = jnp.sum(bits(split) != bits(serial), dtype=jnp.int32)
    got = own(split).astype(jnp.float32)
    error = jnp.linalg.norm(got - want) / jnp.linalg.norm(want)
    nonfinite = jnp.sum(~jnp.isfinite(split), dtype=jnp.int32)
    return mismatches.reshape(1), error.reshape(1), nonfinite.reshape(1), call + 1


def compile_check(case: Case, mode: str, mesh: Mesh, *, config: TailConfig, seed: int, oracle: Oracle,
                  dump_to: str | os.PathLike | None = None):
    """(the compiled check of ``case`` on every device of ``mesh``, with ``mode``'s options on a GPU; its
    kCommandBuffer thunks, counted in XLA's dump: None on a CPU). ``dump_to``: a directory that keeps that dump;
    None: a temporary one."""
    platform = device_platform(mesh.devices.flat[0])
    body = functools.partial(check_call, case=case, config=config, seed=seed, platform=platform, oracle=oracle)
    # Pallas's interpreter takes no values varying over shard_map's axes: where the kernel runs interpreted the
    # axes go unchecked (as in k3_tail.forward), and each device runs its own kernel.
    mapped = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P(AXIS_NAME),) * 3 + (P(),),
                           check_vma=platform in GPU_PLATFORMS)
    lowered = jax.jit(mapped).lower(jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())))
    if platform not in GPU_PLATFORMS:
        return lowered.compile(), None
    with tempfile.TemporaryDirectory(prefix="k3_tail_acceptance_") as temporary:
        dump = temporary if dump_to is None else os.fspath(dump_to)
        compiled = lowered.compile(compiler_options={**MODE_OPTIONS[mode], "xla_dump_to": dump})
        launches = read_launches(dump, parse_module(compiled.as_text()).name)
    return compiled, sum(launch.kind == "kCommandBuffer" for launch in launches)


def run_case(case: Case, mode: str, mesh: Mesh, *, calls: int, first_call: int, config: TailConfig, seed: int,
             oracle: Oracle = serial_split_oracle) -> dict:
    """``calls`` back-to-back checked calls of ``case`` in ``mode``, call indices from ``first_call``: the
    case's report (status "pass" or "fail"; "not applicable on cpu" for command buffers there, not run)."""
    device = mesh.devices.flat[0]
    platform = device_platform(device)
    grid = fused_grid(case.num_tokens, config.latent_size, _block_width(config))
    report = {"case": case.name, "num_tokens": case.num_tokens, "kernel": case.kernel_format, "mode": mode,
              "programs": grid.programs, "splits": grid.splits, "devices": mesh.size, "device_kind": device.device_kind,
              "platform": platform, "jax": jax.__version__}
    if mode == "command_buffers" and platform not in GPU_PLATFORMS:
        return {**report, "status": f"not applicable on {platform}"}
    compiled, command_buffers = compile_check(case, mode, mesh, config=config, seed=seed, oracle=oracle)
    start = time.perf_counter()
    call, results = jax.device_put(np.int32(first_call), NamedSharding(mesh, P())), []
    for _ in range(calls):
        *result, call = compiled(call)
        results.append(result)
    mismatches, errors, nonfinite = (np.stack(values) for values in zip(*jax.device_get(results), strict=True))
    seconds = time.perf_counter() - start
    graphed = command_buffers is None or (command_buffers > 0) == (mode == "command_buffers")
    passed = graphed and not mismatches.any() and not nonfinite.any() and errors.max() <= RELATIVE_TOLERANCE
    ranks = sorted({(c + d) % TP_SIZE for c in range(first_call, first_call + calls) for d in range(mesh.size)})
    return {**report, "status": "pass" if passed else "fail", "calls": calls, "ranks": ranks,
            "mismatches": int(mismatches.sum()), "mismatching_calls": int(mismatches.any(axis=1).sum()),
            "max_relative_error": float(errors.max()), "tolerance": RELATIVE_TOLERANCE,
            "nonfinite": int(nonfinite.sum()), "command_buffer_thunks": command_buffers, "seconds": seconds}


def run_cases(cases, mesh: Mesh, *, calls: int, config: TailConfig, seed: int,
              oracle: Oracle = serial_split_oracle) -> list[dict]:
    """:func:`run_case` of every case in every mode of :data:`MODES`, with a progress bar, the call indices
    running on from case to case (so that few calls a case still cover every rank)."""
    reports = []
    for case, mode in stepped([(case, mode) for case in cases for mode in MODES], lambda item: f"{item[0].name} "
                              f"{item[1]}"):
        first_call = sum(report.get("calls", 0) for report in reports)
        reports.append(run_case(case, mode, mesh, calls=calls, first_call=first_call, config=config, seed=seed,
                                oracle=oracle))
    return reports


def all_passed(reports: list[dict]) -> bool:
    """Whether no report failed (one not applicable here is no pass either, but no failure)."""
    return all(report["status"] != "fail" for report in reports)


def format_reports(reports: list[dict]) -> str:
    """The reports as a table, with the verdict below it."""
    return format_table(reports, [
        ("case", "<18", lambda r: r["case"]), ("mode", "<17", lambda r: r["mode"]),
        ("calls", ">7", lambda r: r.get("calls", "-")), ("mismatches", ">12", lambda r: r.get("mismatches", "-")),
        ("max rel err", ">13", lambda r: f"{r['max_relative_error']:.2e}" if "calls" in r else "-"),
        ("non-finite", ">12", lambda r: r.get("nonfinite", "-")), ("  status", "<24", lambda r: f"  {r['status']}"),
    ], notes=["", f"{'PASS' if all_passed(reports) else 'FAIL'}: bits against the serial split, relative error <= "
              f"{RELATIVE_TOLERANCE:g} against the float32 reference"])


def kernel_ratios(rows: list[dict]) -> list[dict]:
    """Per T in gpu_profile ``rows``: the Pallas kernel's row (the tier whose record says where it compiles: the
    fused kernel's) median over the fastest XLA tier's (< 1: faster)."""
    ratios = []
    for num_tokens in sorted({row["num_tokens"] for row in rows}):
        at = [row for row in rows if row["num_tokens"] == num_tokens]
        fused = [row for row in at if Tier.parse(row["tier"]).record.own_kernel is not None]
        kernel = next(iter(fused), None)
        fastest = min((row for row in at if row not in fused), key=lambda row: row["median_s"])
        if kernel is not None:
            ratios.append({"num_tokens": num_tokens, "kernel_s": kernel["median_s"], "fastest_xla_tier":
                           fastest["tier"], "fastest_xla_s": fastest["median_s"],
                           "ratio": kernel["median_s"] / fastest["median_s"]})
    return ratios
