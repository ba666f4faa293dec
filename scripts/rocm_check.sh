#!/usr/bin/env bash
# Run k3_tail's parity tests and GPU schedule checks on this host's ROCm GPUs (8 for the full set).
#
# Usage: scripts/rocm_check.sh [extra pytest arguments]
# Needs: jax with a working ROCm plugin (pip install -e '.[rocm]': jax[rocm7-local], on a ROCm 7 host) and
# the project installed with its test tools (pip install -e '.[dev]'). Nothing here forces CPU devices:
# JAX_PLATFORMS=rocm makes the tests use the GPUs, and tests/conftest.py then runs the `rocm` tests
# (the schedule of every tier compiled for the real mesh: k3_tail.xla_report's overlap verdict,
# collective kinds and shapes, GEMM FLOPs) that are skipped everywhere else, and the watch-list of
# tests/test_rocm_watch.py: the column-parallel and token-parallel tiers at the row counts where
# hipBLASLt's C-accumulating bf16 GEMM has faulted for vLLM (XLA may fuse "dot + add" into one).
# FP8 up-projection weights run in the parity design (both formats) and in the schedule checks, in the
# format the GPUs multiply (E4M3FNUZ on MI300X/MI325X, E4M3FN otherwise), plus tests/test_up_projection.py.
# The one-token checks (one GEMM per tier, bytes at T = 1 against T = 2, temporary memory) run in the
# schedule checks, and the shared output reduced before the tail in the parity design and
# tests/test_shared_reduction.py. Quantised sums (vLLM ROCm's QuickReduce codecs) run in the parity
# design (every codec), tests/test_quantized_sums.py (codecs, the two-shot sum on the GPUs, the size
# window) and the schedule checks (wire bytes of the quantised shots, the unquantised decode program).
#
# Then the compiled-program tests (pytest -m compiled: schedules, one-token bytes, FP8 GEMMs, quantised wire
# bytes, the cost model's agreement, the layer's cost and placement), which CI runs for deviceless MI300X and
# MI355X topologies with stand-in ROCm libraries, here against this host's own plugin and libraries (a ROCm host
# never gets stand-ins): for the deviceless 8 x MI300X and 8 x MI355X topologies and for the host's real mesh
# ("rocm"); K3_TAIL_TEST_TOPOLOGIES overrides that list (e.g. h100x8 too, with the [aot] extra).
#
# XLA options: none are needed from the environment. k3_tail.compile_tail applies its own per
# executable (k3_tail.compiler_options: for the overlap tier xla_gpu_all_reduce_combine_threshold_bytes=0,
# xla_gpu_all_gather_combine_threshold_bytes=0 and xla_gpu_disable_async_collectives=""), and these
# override XLA_FLAGS. To see XLA's ROCm passes,
# add XLA_FLAGS=--xla_dump_to=DIR; the dump also holds this GPU's exact target config
# (*.gpu_target_config.pbtxt), which can replace k3_tail/deviceless/targets/mi300x.txtpb or mi355x.txtpb.
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=rocm
python -c 'import jax; d = jax.devices(); print(f"jax {jax.__version__}: {len(d)} x {d[0].device_kind} ({d[0].client.platform_version})")'
python -m pytest tests/test_tiers.py tests/test_sequence_parallel.py tests/test_per_rank.py tests/test_forward.py \
    tests/test_collectives.py tests/test_rocm_watch.py tests/test_up_projection.py \
    tests/test_module.py tests/test_schedule.py tests/test_shared_reduction.py tests/test_quantized_sums.py \
    -m "(rocm or not rocm) and not compiled" "$@"
python -m pytest tests -m compiled --topologies "${K3_TAIL_TEST_TOPOLOGIES:-mi300xx8,mi355xx8,rocm}" "$@"
