"""Helpers shared by the test modules: what is installed (the extras), meshes (deviceless GPU topologies among
them), the (tier, weight layout) pairs, once-per-session results, pairwise params of a product and running one case
of the covering design (tests/covering.py), and the column tier's contract check.

Import them with ``from helpers import ...`` (``conftest.py`` only sets up the platform and the hooks).
"""

import atexit
import dataclasses
import functools
import importlib.util
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import covering
import k3_tail
import k3_tail.xla.report
import machine_code
from k3_tail.tiers.column_parallel import stitched_buffer
from k3_tail.tiers.context import TailCall
from reference import TOLERANCE, make_inputs, reference_latent, relative_error

# LLVM's optimisation and XLA CPU's newer (MLIR) fusion emitters off: XLA compiles the same HLO programs in
# about a quarter of the CPU time (measured: 0.25 s instead of 1.0-1.3 s per program), which the suite's
# time budget needs; and XLA CPU's LLVM module in one piece, not split for parallel codegen threads (about 12%
# less CPU per compile on the suite's 2 cores, measured). For programs and processes whose results the tests
# check, not their speed; all are XLA DebugOptions (every backend accepts them; the LLVM level is codegen's only)
# and change no HLO and no platform choice. As per-executable compiler options, and as XLA_FLAGS for the test
# process on the CPU backend (tests/conftest.py) and the processes the tests start.
FAST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_parallel_codegen_split_count": 1}
# The XLA of jax 0.12 no longer has the fusion-emitter switch, and XLA aborts on an unknown flag.
if jax.__version_info__ < (0, 11):
    FAST_COMPILE_OPTIONS["xla_cpu_use_fusion_emitters"] = False
FAST_COMPILE_XLA_FLAGS = " ".join(f"--{name}={str(value).lower()}" for name, value in FAST_COMPILE_OPTIONS.items())


def command_environment():
    """The environment of a command the tests start as a user would (``python -m k3_tail ...``, a
    script): no JAX_PLATFORMS and no forced device count (the command chooses), compiled fast."""
    environment = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return {**environment, "XLA_FLAGS": FAST_COMPILE_XLA_FLAGS}


# The deviceless GPU topologies the compiled-program tests compile for (k3_tail.topology_mesh), and "rocm": the
# real ROCm mesh of the host (scripts/rocm_check.sh). K3_TAIL_TEST_TOPOLOGIES (or pytest's --topologies, which
# sets it) names the ones to run, comma-separated: a named topology that cannot compile here is a failure, one
# not named is skipped. Unset, every topology runs where it can and skips (with the reason) where it cannot:
# the ROCm ones need the [rocm-aot] extra, which .ci/run installs in an environment of its own (.venv-rocm).
GPU_TOPOLOGIES = ("h100x8", "mi300xx8", "mi355xx8")
TOPOLOGIES_VARIABLE = "K3_TAIL_TEST_TOPOLOGIES"


def script_module(path):
    """The script at ``path`` (scripts/ and examples/ are no packages) as a module, loaded with its folder on
    ``sys.path`` so that it imports the scripts beside it as it does when run."""
    path = Path(path)
    sys.path.insert(0, str(path.parent))
    try:
        specification = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(specification)
        specification.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def named_topologies():
    """The topologies K3_TAIL_TEST_TOPOLOGIES names, or None when it is unset (every one where it can)."""
    value = os.environ.get(TOPOLOGIES_VARIABLE, "").strip()
    return None if not value else tuple(name.strip().lower() for name in value.split(",") if name.strip())


def topology_params(*topologies, slow=()):
    """pytest params for the ``topology`` of a compiled-program test: each marked ``compiled`` (and ``rocm`` for
    the host's ROCm mesh, ``slow`` for those in ``slow``: the full cross)."""
    params = []
    for topology in topologies:
        marks = [pytest.mark.compiled]
        if topology == "rocm":
            marks.append(pytest.mark.rocm)
        if topology in slow:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(topology, marks=marks, id=topology))
    return params


def gpu_mesh_for(topology, tp_size=8):
    """The mesh of a ``topology`` param: the host's ROCm devices for "rocm", else ``k3_tail.topology_mesh``;
    skipped when K3_TAIL_TEST_TOPOLOGIES leaves it out, or (when that is unset) when it cannot compile here."""
    named = named_topologies()
    if named is not None and topology not in named:
        pytest.skip(f"{topology}: not in {TOPOLOGIES_VARIABLE}={','.join(named)}")
    if topology == "rocm":
        return jax.make_mesh((tp_size,), ("tp",), devices=jax.devices()[:tp_size])
    try:
        return k3_tail.topology_mesh(topology)
    except k3_tail.TopologyUnavailable as error:
        if named is not None:
            pytest.fail(f"{topology} is named in {TOPOLOGIES_VARIABLE} but cannot compile here: {error}", pytrace=False)
        if k3_tail.deviceless.topologies.parse_topology(topology)[0].platform == "rocm" and not ROCM_WHEELS:
            pytest.skip(f"{topology}: needs the [rocm-aot] extra (.ci/run runs it in .venv-rocm)")
        pytest.skip(str(error))


def installed(module):
    """Whether ``module`` (a dotted name) is installed here, found without importing it. find_spec of a submodule
    imports its parent and raises where the parent is missing (``jax_plugins`` exists only where some plugin is,
    not in an environment of the project alone): each parent is looked for first."""
    parent = module.rpartition(".")[0]
    return (not parent or installed(parent)) and importlib.util.find_spec(module) is not None


def needs_extra(extra, *modules):
    """A skip mark for a test that needs the ``extra`` of pyproject.toml (the README's set-up installs none):
    skipped, naming the extra, where one of ``modules`` is not installed."""
    missing = [module for module in modules if not installed(module)]
    return pytest.mark.skipif(bool(missing), reason=f"needs the [{extra}] extra ({', '.join(missing)} not installed)")


# Whether the ROCm plugin is installed (the [rocm-aot] extra).
ROCM_WHEELS = installed("jax_plugins.xla_rocm7")


def topology_available(topology):
    """Whether ``k3_tail.topology_mesh(topology)`` works here (for tests that compile in another process)."""
    try:
        k3_tail.topology_mesh(topology)
    except k3_tail.TopologyUnavailable:
        return False
    return True


def compiled_tail(config, mesh, num_tokens, tier, weight_layout):
    """``k3_tail.compile_tail`` once per process for the same arguments: the GPU schedule tests and the cost
    model's agreement tests compile many of the same programs."""
    return _compiled_and_dumped(config, mesh, num_tokens, tier, weight_layout)[0]


def compiled_report(config, mesh, num_tokens, tier, weight_layout):
    """The :class:`k3_tail.XlaReport` of :func:`compiled_tail`'s program, its GPU kernels included (from XLA's
    dump of that compile)."""
    compiled, dump_dir = _compiled_and_dumped(config, mesh, num_tokens, tier, weight_layout)
    return k3_tail.xla.report.report(compiled, dump_dir=dump_dir)


def compiled_dump(config, mesh, num_tokens, tier, weight_layout):
    """The directory of XLA's dump of :func:`compiled_tail`'s program (None for a CPU program)."""
    return _compiled_and_dumped(config, mesh, num_tokens, tier, weight_layout)[1]


@functools.cache
def _compiled_and_dumped(config, mesh, num_tokens, tier, weight_layout):
    """(compiled, dump directory): a GPU program is compiled with XLA's dump, in a directory of this process
    that goes when it ends; a CPU program without."""
    dump_dir = None
    if mesh.devices.flat[0].platform != "cpu":
        dump_dir = tempfile.mkdtemp(prefix="k3_tail_test_dump_", dir=_dump_root())
    compiled = k3_tail.compile_tail(config, mesh, num_tokens, tier=tier, weight_layout=weight_layout, dump_to=dump_dir)
    return compiled, dump_dir


@functools.cache
def _dump_root():
    root = tempfile.mkdtemp(prefix="k3_tail_test_dumps_")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def make_tp_mesh(tp_size, axis_type=jax.sharding.AxisType.Explicit):
    """A 1-d mesh named "tp" over the first ``tp_size`` devices (skips when there are fewer)."""
    if len(jax.devices()) < tp_size:
        pytest.skip(f"needs {tp_size} devices, have {len(jax.devices())}")
    return jax.make_mesh((tp_size,), ("tp",), axis_types=(axis_type,), devices=jax.devices()[:tp_size])


def tier_layouts():
    """Every (tier, weight layout) pair that runs (a tier that needs the whole kernel: replicated only)."""
    return [
        pytest.param(tier, layout, id=f"{tier.value}-{layout}")
        for tier in k3_tail.Tier
        for layout in k3_tail.ops.columns.WEIGHT_LAYOUTS
        if tier.supports(layout)
    ]


def layout_for(tier, preferred="column"):
    """``preferred`` when ``tier`` runs with it, else "replicated"."""
    return preferred if tier.supports(preferred) else "replicated"


def once_per_session(tmp_path_factory, name, produce, *, timeout_s):
    """``produce(directory)``'s JSON-serialisable result, computed once per test session.

    Under pytest-xdist every worker asks for it; the worker that creates the shared directory first
    runs ``produce`` there and the others wait for its result (at most ``timeout_s``). Returns
    (directory, result). A ``produce`` that raises fails every test that asked for the result.
    """
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's directory, above each worker's own
    directory = shared / name
    result_path = directory / "result.json"
    try:
        directory.mkdir()  # atomic: exactly one worker gets here first
    except FileExistsError:
        deadline = time.monotonic() + timeout_s
        while not result_path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not result_path.exists():
            pytest.fail(f"{name}: the worker producing it did not finish within {timeout_s} s", pytrace=False)
    else:
        outcome = {"error": "interrupted"}
        try:
            outcome = {"result": produce(directory)}
        except Exception as error:  # reported below, to this worker's tests and the others' alike
            outcome = {"error": f"{type(error).__name__}: {error}"}
        finally:
            # Written whole, then renamed: a waiting worker never reads half of it.
            partial = directory / "result.partial"
            partial.write_text(json.dumps(outcome))
            partial.rename(result_path)
    outcome = json.loads(result_path.read_text())
    if "error" in outcome:
        pytest.fail(f"{name}: {outcome['error']}", pytrace=False)
    return directory, outcome["result"]


def pairwise_params(factors, id_of, constraint=None):
    """pytest params of the product of ``factors`` (name -> values, hashable), each case its values in factor order,
    named ``id_of(values)``: the cases of a pairwise covering design (``covering.pairwise_cases``: every feasible pair
    of values of any two factors) run by default, the rest of the product are marked ``slow`` (``pytest -m slow``).
    ``constraint`` (a predicate on a dict of the factors set so far, as covering's) leaves out the cases it refuses."""
    design = {tuple(case.values()) for case in covering.pairwise_cases(factors, constraint=constraint)}
    return [pytest.param(*values, id=id_of(values), marks=() if values in design else pytest.mark.slow)
            for values in itertools.product(*factors.values())
            if constraint is None or constraint(dict(zip(factors, values, strict=True)))]


def tier_supports_layout(case):
    """A covering constraint (:func:`pairwise_params`): the case's tier runs with its weight layout (either unset: yet
    unknown)."""
    return "tier" not in case or "weight_layout" not in case or case["tier"].supports(case["weight_layout"])


def case_config(case):
    """The TailConfig of a covering case (tests/covering.py): its shapes, dtype, scale, norm, SP output,
    up-projection weights and quantised sums (every sum quantised, however small)."""
    return k3_tail.TailConfig(
        hidden_size=case.hidden_size,
        latent_size=covering.LATENT_SIZE,
        dtype=jnp.dtype(case.dtype),
        routed_scaling_factor=case.routed_scaling_factor,
        use_latent_norm=case.use_latent_norm,
        sequence_parallel=case.sequence_parallel,
        up_proj_dtype=case.up_proj_dtype,
        fp8_activations=case.fp8_activations,
        shared_output_is_reduced=case.shared_output_is_reduced,
        all_reduce_quantization=case.all_reduce_quantization,
        quantized_all_reduce_min_bytes=0 if case.all_reduce_quantization else None,
    )


def run_case(case):
    """(config, inputs, y): ``k3_tail.tail_forward`` of a covering case on a mesh of its p devices.

    The case's tier is forced, or left to the library when it is "selected"; the norm weight is
    passed only when the latent norm is on (``tail_forward`` wants None otherwise), the shared
    partials summed when the case's shared output arrives reduced.
    """
    config = case_config(case)
    inputs = make_inputs(config, case.tp_size, case.num_tokens)
    y = k3_tail.tail_forward(
        inputs.routed,
        reduced_shared(config, inputs.shared) if config.shared_output_is_reduced else inputs.shared,
        inputs.norm_weight if config.use_latent_norm else None,
        inputs.kernel,
        config=config,
        mesh=make_tp_mesh(case.tp_size),
        tier=None if case.tier == "selected" else k3_tail.Tier(case.tier),
        weight_layout=case.weight_layout,
    )
    return config, inputs, y


def token_sharded_rows(y, config, num_tokens, tp_size):
    """The caller's T rows of a sequence-parallel result ``y`` (float32 numpy), once ``y`` has the form
    the library promises for every T: y padded to T' = ``padded_token_count(T, p)`` rows, [T', H] in
    the config's dtype, each rank holding [T'/p, H], and its padding rows T..T'-1 exactly zero."""
    padded = k3_tail.padded_token_count(num_tokens, tp_size)
    assert y.shape == (padded, config.hidden_size) and y.dtype == config.dtype
    assert {shard.data.shape for shard in y.addressable_shards} == {(padded // tp_size, config.hidden_size)}
    values = np.asarray(y, np.float32)
    assert not values[num_tokens:].any(), "the padding rows are not zero"
    return values[:num_tokens]


def reduced_shared(config, shared_partials):
    """The reduced shared output [T, H] a caller passes with ``shared_output_is_reduced``: the sum of the
    [p, T, H] partials in float32, rounded once to the config's dtype (the reference keeps the exact sum)."""
    return np.asarray(jnp.asarray(np.asarray(shared_partials, np.float32).sum(axis=0), config.dtype))


def column_buffers(config, inputs, mesh, weight_layout):
    """The per-rank buffers the column tier hands to its final all-reduce: [p, T, H]."""
    tp_size = mesh.shape["tp"]
    kernel = inputs.kernel
    kernel_spec = P()
    if weight_layout == "column":
        width = k3_tail.padded_hidden_size(config.hidden_size, tp_size)
        kernel = np.pad(kernel, [(0, 0), (0, width - config.hidden_size)])
        kernel_spec = P(None, "tp")
    def buffer(r, s, g, w):
        call = TailCall.inside_shard_map(config, axis_name="tp", weight_layout=weight_layout, platform=None)
        return stitched_buffer(r[0], s[0], g, w, call)[None]

    buffers = jax.jit(jax.shard_map(
        buffer,
        mesh=mesh,
        in_specs=(P("tp"), P("tp"), P(), kernel_spec),
        out_specs=P("tp"),
    ))
    place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return np.asarray(
        buffers(
            place(inputs.routed, P("tp")), place(inputs.shared, P("tp")), place(inputs.norm_weight, P()),
            place(kernel, kernel_spec),
        )
    )


def assert_column_tier_writes_only_its_own_block(config, tp_size, num_tokens, weight_layout):
    """Rank k's buffer is s_k + latent @ W[:, block k] on block k, and bit-identical s_k elsewhere."""
    inputs = make_inputs(config, tp_size, num_tokens)
    buffers = column_buffers(config, inputs, make_tp_mesh(tp_size), weight_layout)
    assert buffers.shape == inputs.shared.shape and buffers.dtype == inputs.shared.dtype

    latent = reference_latent(config, inputs.routed, inputs.norm_weight)
    block_width = k3_tail.padded_hidden_size(config.hidden_size, tp_size) // tp_size
    for rank in range(tp_size):
        own = slice(rank * block_width, min((rank + 1) * block_width, config.hidden_size))
        others = np.ones(config.hidden_size, bool)
        others[own] = False
        np.testing.assert_array_equal(buffers[rank][:, others], inputs.shared[rank][:, others])
        projection = latent @ inputs.kernel[:, own].astype(np.float64)
        expected_own = inputs.shared[rank][:, own].astype(np.float64) + projection
        assert relative_error(buffers[rank][:, own], expected_own) <= TOLERANCE[config.dtype]


def disassembled(read, *args):
    """``read(*args)``, a reader of tests/machine_code.py (``kernel_code``, ``disassembly``); skipped with
    the command that installs the missing disassembler, a failure under CI (``CI`` set), which installs them."""
    try:
        return read(*args)
    except machine_code.DisassemblerUnavailable as missing:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(missing))


def kimi_layer_compiled(tmp_path_factory, topology, num_tokens, quantization=None):
    """Kimi-K3's layer (896 experts, top 16, routed experts held as ``quantization``: None for bf16) compiled for the
    deviceless ``topology`` at T tokens as ``compile_layer`` compiles it (the tail tier it selects), once per session
    for every test that reads it: {"figures": ``figures.CompiledFigures``' fields, "gemm_flops": XLA's per device,
    "placement": the early shared reduction's ``SharedReductionPlacement`` fields}. Skipped where the topology
    cannot compile (:func:`gpu_mesh_for`)."""
    from k3_tail.models.kimi_k3 import KIMI_K3_NUM_EXPERTS, KIMI_K3_TOP_K, LayerConfig, compile_layer, figures
    from k3_tail.models.kimi_k3.parameters import ROUTED_EXPERT_WEIGHTS
    from k3_tail.models.kimi_k3.schedule import shared_reduction_placement

    mesh = gpu_mesh_for(topology)

    def produce(directory):
        config = LayerConfig.kimi_k3(num_experts=KIMI_K3_NUM_EXPERTS, top_k=KIMI_K3_TOP_K,
                                     expert_quantization=quantization)
        dump_dir = str(directory / "dump")
        compiled = compile_layer(config, mesh, num_tokens, xla_options={"xla_dump_to": dump_dir})
        placement = shared_reduction_placement(compiled, ROUTED_EXPERT_WEIGHTS)
        return {"figures": dataclasses.asdict(figures.figures_of(compiled, dump_dir)),
                "gemm_flops": k3_tail.xla.report.report(compiled, shared_argument=None).gemm_flops,
                "placement": dataclasses.asdict(placement)}

    name = f"kimi-layer-{topology}-T{num_tokens}-{quantization or 'bfloat16'}"
    return once_per_session(tmp_path_factory, name, produce, timeout_s=600)[1]


def preferred_tier_layouts(preferred="column"):
    """:func:`tier_layouts`, each tier's pair with :func:`layout_for` ``(tier, preferred)`` run by default and its
    other pair marked ``slow`` (``pytest -m slow``): for behaviours of a tier that its weight layout does not change,
    both layouts still meet every tier in the covering designs."""
    return [pytest.param(*param.values, id=param.id,
                         marks=() if param.values[1] == layout_for(param.values[0], preferred) else pytest.mark.slow)
            for param in tier_layouts()]
