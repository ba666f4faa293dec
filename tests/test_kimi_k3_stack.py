"""The decoder stack of k3_tail/models/kimi_k3/stack.py: N Kimi-K3 MoE layers, each after its pre-norm, as one scan.

Checked against the float64 reference (``stack.reference_stack``, built on models/kimi_k3/reference.py) at Kimi-K3's
proportions / 16 (H 448, L 224, m 192, F 384), 8 experts, top 2, bf16, N = 3 layers on 8 CPU devices: T = 1 (the
routed experts' gather method) and T = 6, above the decode range (T*k > E: the capacity method); once with MXFP4
experts, on 2 devices (each rank's rows of an expert then whole groups of 32).

Tolerance, relative Frobenius error ||h - ref|| / ||ref|| of the stack's output: bf16 <= sqrt(N) x 1e-2 (each layer's
output within the layer's 1e-2, tests/test_kimi_k3_layer.py, the N errors independent and so adding in quadrature,
and h rounded to bf16, 2^-9, at each residual add); measured 6.9e-3 to 7.9e-3, and 1.0e-2 with the
token-mixing stand-in for attention, which rounds h once more per layer. The bf16 stack feeds layer l the rounded
output of layers < l, which moves its router scores by up to 4.7e-3 (measured): the test inputs keep every layer's
top-k choice a margin of 1e-2 from a tie in the reference, so the stack chooses the experts the reference does.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import FAST_COMPILE_OPTIONS, gpu_mesh_for, make_tp_mesh, once_per_session, topology_params
from hf_checkpoint import TinyModel, moe_layer_weights, tiny_model, write_checkpoint
from k3_tail.models.kimi_k3 import (
    KIMI_K3_NUM_EXPERTS,
    KIMI_K3_TOP_K,
    LayerConfig,
    abstract_parameters,
    layer as layer_module,
    mxfp4_experts,
    stack as stack_module,
)
from k3_tail.models.kimi_k3.checkpoint import layer_config_from_hf
from k3_tail.models.kimi_k3.parameters import ROUTED_EXPERT_SCALES
from k3_tail.models.kimi_k3.reference import choice_margin
from k3_tail.xla import hlo_text, report as xla_report
from reference import relative_error

NUM_LAYERS, TP_SIZE = 3, 8
# Hidden states whose routing stays MIN_CHOICE_MARGIN from a tie at every layer of the reference (module docstring),
# with and without the attention stand-in.
HIDDEN_SEED, ATTENTION_SEED, MIN_CHOICE_MARGIN = 20, 9, 1e-2
TOLERANCE = np.sqrt(NUM_LAYERS) * 1e-2
STATIC_ARGUMENTS = ("config", "mesh", "attention", "axis_name", "weight_layout", "tier")
# Compiled fast (helpers.FAST_COMPILE_OPTIONS): the same programs, in a quarter of the compile time.
stack_forward = jax.jit(stack_module.stack_forward, static_argnames=STATIC_ARGUMENTS,
                        compiler_options=FAST_COMPILE_OPTIONS)


def stack_config(expert_quantization=None, num_layers=NUM_LAYERS):
    layer = LayerConfig.kimi_k3(num_experts=8, top_k=2, width_divisor=16,
                                expert_quantization=expert_quantization)
    return stack_module.StackConfig(layer, num_layers)


@functools.cache
def weights(expert_quantization=None):
    """(per-layer checkpoints, pre_norm) of the test stack."""
    return stack_module.random_stack_weights(stack_config(expert_quantization), seed=0)


@functools.cache
def decoded_weights(expert_quantization=None):
    """The checkpoints with MXFP4 experts decoded (exactly, to float32): what the float64 reference takes."""
    checkpoints, pre_norm = weights(expert_quantization)
    if expert_quantization is None:
        return checkpoints, pre_norm
    scales = ROUTED_EXPERT_SCALES
    decoded = [{**{name: value for name, value in checkpoint.items() if name not in scales.values()},
                **{name: np.asarray(mxfp4_experts.dense(mxfp4_experts.Mxfp4Kernel(checkpoint[name], checkpoint[scale]),
                                                        jnp.float32)) for name, scale in scales.items()}}
               for checkpoint in checkpoints]
    return decoded, pre_norm


@functools.cache
def stack_on(expert_quantization=None):
    """The test stack on 8 devices; with MXFP4 experts on 2 (m = 192 splits into whole groups of 32 over 2 ranks)."""
    checkpoints, pre_norm = weights(expert_quantization)
    mesh = make_tp_mesh(TP_SIZE if expert_quantization is None else 2)
    return stack_module.DecoderStack(stack_config(expert_quantization), mesh, checkpoints, pre_norm)


@functools.cache
def hidden_states(num_tokens, seed=HIDDEN_SEED):
    rng = np.random.default_rng(seed)
    return np.asarray(jnp.asarray(rng.standard_normal((num_tokens, 448)), jnp.bfloat16))


def run_stack(stack, x, attention=None):
    """``stack(x, attention=attention)``, compiled fast."""
    return stack_forward(stack.parameter_values(), jnp.asarray(x), config=stack.config, mesh=stack.mesh,
                         attention=attention)


def expected(expert_quantization, x, attention=None, num_layers=NUM_LAYERS):
    """The reference's h after the first ``num_layers`` layers."""
    checkpoints, pre_norm = decoded_weights(expert_quantization)
    return stack_module.reference_stack(checkpoints[:num_layers], pre_norm[:num_layers], x,
                                        config=stack_config(expert_quantization, num_layers), attention=attention)


def mix_tokens(h):
    """A stand-in for attention, per rank: each token's state averaged with the previous token's (in h's dtype).
    Mixing tokens, it does not commute with the layers, which act on each token alone."""
    return (h + jnp.roll(h, 1, axis=0)) * 0.5


def reference_mix_tokens(h):
    return (h + np.roll(h, 1, axis=0)) / 2


CASES = [pytest.param(None, 1, id="T1"), pytest.param(None, 6, id="T6"), pytest.param("mxfp4", 1, id="mxfp4-T1")]


@pytest.mark.parametrize(("expert_quantization", "num_tokens"), CASES)
def test_the_stack_matches_the_float64_reference(expert_quantization, num_tokens):
    x = hidden_states(num_tokens)
    h = run_stack(stack_on(expert_quantization), x)
    assert h.shape == x.shape and h.dtype == jnp.bfloat16 and h.sharding.is_fully_replicated
    assert relative_error(h, expected(expert_quantization, x)) <= TOLERANCE


def test_the_attention_function_runs_before_every_layer():
    """A per-rank function that mixes tokens: the stack matches the reference with the same function, not without."""
    x = hidden_states(6, ATTENTION_SEED)
    h = run_stack(stack_on(), x, attention=mix_tokens)
    assert relative_error(h, expected(None, x, attention=reference_mix_tokens)) <= TOLERANCE
    assert relative_error(h, expected(None, x)) > 10 * TOLERANCE


@pytest.mark.parametrize(("expert_quantization", "num_tokens", "attention", "seed"), [
    *(pytest.param(*case.values, None, HIDDEN_SEED, id=case.id) for case in CASES),
    pytest.param(None, 6, reference_mix_tokens, ATTENTION_SEED, id="attention-T6")])
def test_no_test_input_is_near_a_routing_tie_at_any_layer(expert_quantization, num_tokens, attention, seed):
    """Layer l's input in the reference: the pre-norm of the (attended) output of the layers before it."""
    checkpoints, pre_norm = decoded_weights(expert_quantization)
    x = hidden_states(num_tokens, seed)
    for index in range(NUM_LAYERS):
        h = expected(expert_quantization, x, attention, num_layers=index) if index else np.asarray(x, np.float64)
        h = attention(h) if attention else h
        normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + stack_config().norm_eps) * pre_norm[index]
        assert choice_margin(checkpoints[index], normed, top_k=2) > MIN_CHOICE_MARGIN, index


def count(text, pattern):
    return len(re.findall(pattern, text))


def test_the_n_layers_are_one_loop_over_one_traced_layer():
    """The lowered stack holds one while loop more than one layer and the layer's collectives once, whatever N; the
    loop body (here the attention function in it) is traced once."""
    traces = []

    def attention(h):
        traces.append(h.shape)  # runs only when jax traces the function
        return h

    config, mesh = stack_config(), make_tp_mesh(TP_SIZE)
    x = jax.ShapeDtypeStruct((6, config.hidden_size), config.dtype, sharding=NamedSharding(mesh, P()))
    stack = stack_module.stack_forward.lower(stack_module.abstract_stack_parameters(config, mesh), x, config=config,
                                             mesh=mesh, attention=attention).as_text()
    layer = layer_module.layer_forward.lower(abstract_parameters(config.layer, mesh), x,
                                             config=config.layer, mesh=mesh).as_text()
    assert traces == [(6, config.hidden_size)]
    assert count(stack, r"stablehlo\.while") == count(layer, r"stablehlo\.while") + 1
    collectives = r"stablehlo\.(?:all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)\b"
    assert count(stack, collectives) == count(layer, collectives) > 0


@pytest.fixture(scope="module")
def hf_stack(tmp_path_factory):
    """A tiny Kimi-K3 checkpoint (tests/hf_checkpoint.py: layer 0 dense, 1 and 2 MoE), its config, the tensors."""
    model = TinyModel(hidden_size=16)
    tensors = tiny_model(model, seed=1)
    path = write_checkpoint(tmp_path_factory.mktemp("kimi_stack") / "ckpt", tensors, config=model.config())
    return path, stack_module.StackConfig(layer_config_from_hf(path), 2), tensors


def test_n_layers_loaded_from_a_hugging_face_checkpoint_compute_what_the_same_weights_in_memory_compute(hf_stack):
    path, config, tensors = hf_stack
    mesh = make_tp_mesh(4)
    loaded = stack_module.load_stack(path, [1, 2], config=config, mesh=mesh)
    checkpoints = [moe_layer_weights(tensors, layer, config.layer.num_experts) for layer in (1, 2)]
    pre_norm = np.stack([tensors[f"model.layers.{layer}.post_attention_layernorm.weight"] for layer in (1, 2)])
    built = stack_module.DecoderStack(config, mesh, checkpoints, pre_norm)
    x = np.asarray(jnp.asarray(np.random.default_rng(0).standard_normal((3, 16)), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(run_stack(loaded, x), np.float32), np.asarray(run_stack(built, x),
                                                                                          np.float32))


def test_a_missing_pre_norm_is_a_value_error_naming_the_tensor(hf_stack, tmp_path):
    _, config, tensors = hf_stack
    name = "model.layers.2.post_attention_layernorm.weight"
    path = write_checkpoint(tmp_path / "ckpt", {key: value for key, value in tensors.items() if key != name},
                            config=TinyModel(hidden_size=16).config())
    with pytest.raises(ValueError, match=rf"^layer 2: language_model\.{re.escape(name)}: missing from the checkpoint"):
        stack_module.load_stack(path, [1, 2], config=config, mesh=make_tp_mesh(4))


def with_first_layer_entry(change):
    """The test stack's parameters with the first of the layers' arrays changed by ``change`` (None: dropped)."""
    values = stack_on().parameter_values()
    first, *rest = values["layers"]
    layers = {name: values["layers"][name] for name in rest}
    if change is not None:
        layers[first] = change(values["layers"][first])
    return {**values, "layers": layers}


def call_with(parameters=None, x=None, attention=None, config=None):
    stack = stack_on()
    return stack_module.stack_forward(stack.parameter_values() if parameters is None else parameters,
                                      jnp.zeros((2, 448), jnp.bfloat16) if x is None else x,
                                      config=config or stack.config, mesh=stack.mesh, attention=attention)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: stack_module.StackConfig(stack_config().layer, 0), r"^num_layers: expected an integer >= 1"),
    (lambda: stack_module.StackConfig(stack_config().layer, 2, norm_eps=0.0), r"^norm_eps: expected a finite number"),
    (lambda: stack_module.StackConfig(stack_config().layer.tail, 2), r"^layer: expected a LayerConfig"),
    (lambda: stack_module.StackConfig(LayerConfig.kimi_k3(width_divisor=16, sequence_parallel=True), 2),
     r"^layer: the stack's residual stream is replicated"),
    (lambda: call_with(x=jnp.zeros((2, 448), jnp.float32)), r"^hidden_states: expected a \[T, 448\] array of bfloat16"),
    (lambda: call_with({**stack_on().parameter_values(), "norm": None}), r"^parameters: expected the names"),
    (lambda: call_with(with_first_layer_entry(None)), r"^parameters: expected layers with the names"),
    (lambda: call_with(with_first_layer_entry(lambda value: value[:2])),
     r"^parameters: expected layers\.\w+ of shape \(3, .*\[num_layers = 3"),
    (lambda: call_with(config=stack_config(num_layers=4)), r"^parameters: expected pre_norm of shape \(4, 448\)"),
    (lambda: call_with(attention=lambda h: h.astype(jnp.float32)), r"^attention: expected it to return h's shape"),
    (lambda: call_with(attention="roll"), r"^attention: expected a function"),
    (lambda: stack_module.DecoderStack(stack_config(), make_tp_mesh(TP_SIZE), weights()[0][:2], weights()[1]),
     r"^layers: expected 3 layers \(config\.num_layers\), got 2"),
    (lambda: stack_module.DecoderStack(stack_config(), make_tp_mesh(TP_SIZE), weights()[0], weights()[1][:2]),
     r"^pre_norm: expected shape \(3, 448\)"),
], ids=["no-layers", "eps", "config-type", "sequence-parallel", "hidden-dtype", "group-names", "layer-names",
        "layer-count-of-an-entry", "num-layers", "attention-output", "attention-type", "stack-layers", "pre-norm"])
def test_bad_input_is_a_value_error_naming_it(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_loading_another_number_of_layers_than_the_config_is_a_value_error_naming_layers(hf_stack):
    path, config, _ = hf_stack
    with pytest.raises(ValueError, match=r"^layers: expected 2 layer indices \(config\.num_layers\), got \(1,\)"):
        stack_module.load_stack(path, [1], config=config, mesh=make_tp_mesh(4))


# ---- Compiled for 8 GPUs at Kimi-K3's sizes ----------------------------------------------------------------------

# T = 16 takes T = 1's route (the gather method) through the same loop: it repeats what T = 1 proves of the loop and
# what it holds, and runs with ``pytest -m slow``.
COMPILED_LAYERS, COMPILED_TOKENS = 4, (1, pytest.param(16, marks=pytest.mark.slow))
# What the scan may add to one layer's temp memory: a margin for loop bookkeeping and the carried h, far below one
# layer's weights per rank (GBs), so that no copy of a layer's (or the stack's) weights fits in it.
TEMP_MARGIN_FRACTION, TEMP_MARGIN_BYTES = 0.10, 8 << 20
_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?$")


def program_figures(compiled, dump_dir):
    """Per rank: kernels (XLA's dump), collective instructions in the program (a loop body's once), bytes accessed
    and temp bytes."""
    module = hlo_text.parse_module(compiled.as_text())
    collectives = sum(bool(_COLLECTIVE.match(instruction.opcode)) for computation in module.computations.values()
                      for instruction in computation.instructions)
    report = xla_report.report(compiled, shared_argument=None, dump_dir=dump_dir)
    return {"kernels": report.gpu_kernel_count, "collectives": collectives, "bytes_accessed": report.bytes_accessed,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}


def compiled_figures(tmp_path_factory, topology, num_tokens):
    """{"layer": ..., "stack": ...}: one Kimi-K3 layer (896 experts, top 16) and a stack of 4, each as
    compile_layer / compile_stack compile it for T tokens, with XLA's dump; once per session."""
    mesh = gpu_mesh_for(topology)
    config = stack_module.StackConfig(LayerConfig.kimi_k3(num_experts=KIMI_K3_NUM_EXPERTS,
                                                          top_k=KIMI_K3_TOP_K),
                                      COMPILED_LAYERS)

    def produce(directory):
        figures = {}
        for what, compile_program in (("layer", functools.partial(layer_module.compile_layer, config.layer)),
                                      ("stack", functools.partial(stack_module.compile_stack, config))):
            dump_dir = str(directory / what)
            compiled = compile_program(mesh, num_tokens, xla_options={"xla_dump_to": dump_dir})
            figures[what] = program_figures(compiled, dump_dir)
        return figures

    name = f"kimi_k3_stack_{topology}_T{num_tokens}"
    return once_per_session(tmp_path_factory, name, produce, timeout_s=1800)[1]


# Measured with jax 0.10.2 (H100) and 0.12 (MI300X): the routed experts' kernels read the stacked experts in place
# (stack_forward hands them whole with the layer's index), but XLA copies each trip's packed input kernel out of the
# stacked arrays before its GEMM (a loop-indexed dynamic slice).
INPUT_KERNEL_COPY = ("XLA copies each trip's input kernel [H, E + L + 2F/p] (86 MB per rank) out of the stacked "
                     "arrays before its GEMM: stack temp 87-152 MB per rank against one layer's 0.2-3.5 MB; the "
                     "routed experts (7.4 GB a layer) are read in place")
COPIES_EACH_TRIP = dict.fromkeys(("h100x8", "mi300xx8", "mi355xx8"), INPUT_KERNEL_COPY)


@pytest.mark.parametrize("num_tokens", COMPILED_TOKENS)
@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8", "mi355xx8"))
def test_the_compiled_stack_holds_no_copy_of_its_weights(topology, num_tokens, tmp_path_factory, request):
    """Temp memory of 4 layers as a scan: one layer's and a margin, whatever N (a copy of one layer's weights per
    rank would add GBs). Expected to fail, strictly, where XLA is known to copy (COPIES_EACH_TRIP)."""
    if topology in COPIES_EACH_TRIP:
        request.applymarker(pytest.mark.xfail(strict=True, reason=COPIES_EACH_TRIP[topology]))
    figures = compiled_figures(tmp_path_factory, topology, num_tokens)
    layer, stack = figures["layer"], figures["stack"]
    print(f"{topology} T = {num_tokens}: layer {layer}, stack of {COMPILED_LAYERS} {stack}")
    assert stack["temp_bytes"] <= layer["temp_bytes"] * (1 + TEMP_MARGIN_FRACTION) + TEMP_MARGIN_BYTES


@pytest.mark.parametrize("num_tokens", COMPILED_TOKENS)
@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8", "mi355xx8"))
def test_the_compiled_stack_is_one_layer_program_in_a_loop(topology, num_tokens, tmp_path_factory):
    """The stack's program holds each of the layer's collectives once (in the loop body), and fewer kernels than 4
    copies of the layer: one layer's, the trip's slices of the stacked arrays, the pre-norm and the residual add
    (14 to 23 measured on the three targets, against the layer's 8)."""
    figures = compiled_figures(tmp_path_factory, topology, num_tokens)
    layer, stack = figures["layer"], figures["stack"]
    assert stack["collectives"] == layer["collectives"] > 0
    assert layer["kernels"] < stack["kernels"] < COMPILED_LAYERS * layer["kernels"]
