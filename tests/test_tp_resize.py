"""A tail's saved state restored at another TP size: LatentMoETail.restore, checkpoint.restore_tail_state.

Tails of H = 100 (padded to 104 columns at p = 8, none at p = 4 or 2) and of H = 96 (no padding), L = 64, are
saved with orbax's StandardCheckpointer at p and restored at p' on the forced CPU devices: 4 -> 8 widens the
column layout's kernel, 8 -> 2 narrows it. The restored parameters must be the saved ones column for column,
bit for bit, in the shapes and shardings a tail of p' ranks is built with, and the tail must compute the same y.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import k3_tail
from helpers import make_tp_mesh, pairwise_params
from k3_tail.checkpoint import restore_tail_state
from k3_tail.models.kimi_k3 import LayerConfig, layer as layer_module
from k3_tail.models.kimi_k3.saved_layer import restore_layer
from reference import TOLERANCE, relative_error

CONFIG = k3_tail.TailConfig(hidden_size=100, latent_size=64)
FP8 = "float8_e4m3fn"
LAYOUTS = k3_tail.ops.columns.WEIGHT_LAYOUTS


def saved_tail(config, tp_size, weight_layout="column", seed=0):
    """A tail of ``tp_size`` ranks with a random kernel and a norm scale other than ones (so both are seen)."""
    tail = k3_tail.LatentMoETail(config, make_tp_mesh(tp_size), rngs=nnx.Rngs(seed), weight_layout=weight_layout)
    if tail.norm_scale is not None:
        norm = 1 + 0.1 * jax.random.normal(jax.random.key(seed + 1), (config.latent_size,))
        tail.norm_scale.set_value(jax.device_put(norm.astype(config.dtype), tail.norm_scale[...].sharding))
    return tail


def save(tail, directory):
    """``nnx.state(tail)`` saved to ``directory`` as the guide's recipe saves it."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory, nnx.state(tail))
    checkpointer.wait_until_finished()
    checkpointer.close()
    return directory


def restored_without_target(directory):
    """What orbax restores from ``directory`` when given no target: ``{"up_proj_kernel": {"value": array}, ...}``."""
    checkpointer = ocp.StandardCheckpointer()
    state = checkpointer.restore(directory)
    checkpointer.close()
    return state


def bits(x):
    """The bytes of an array of any dtype (FP8 included), to compare bit for bit."""
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def first_rank_inputs(config, tp_size, num_tokens=16):
    """[p, T, L] and [p, T, H] partials where rank 0 holds all of the sums, so tails of any p take the same y."""
    keys = jax.random.split(jax.random.key(7))
    routed = jnp.zeros((tp_size, num_tokens, config.latent_size), config.dtype)
    shared = jnp.zeros((tp_size, num_tokens, config.hidden_size), config.dtype)
    routed = routed.at[0].set(jax.random.normal(keys[0], routed.shape[1:]).astype(config.dtype))
    shared = shared.at[0].set(jax.random.normal(keys[1], shared.shape[1:]).astype(config.dtype))
    return routed, shared


# Every pair of a resize (widening or narrowing), H (padded at p = 8 or not), the kernel's dtype and the layout; the
# whole product with ``pytest -m slow``.
def restore_case_id(values):
    (from_tp, to_tp), hidden_size, up_proj_dtype, weight_layout = values
    return f"{from_tp}to{to_tp}-H{hidden_size}-{'fp8' if up_proj_dtype else 'bf16'}-{weight_layout}"


RESTORE_CASES = pairwise_params(
    {"resize": ((4, 8), (8, 2)), "hidden_size": (100, 96), "up_proj_dtype": (None, FP8), "weight_layout": LAYOUTS},
    restore_case_id)


@pytest.mark.parametrize(("resize", "hidden_size", "up_proj_dtype", "weight_layout"), RESTORE_CASES)
def test_restored_parameters_are_the_saved_ones_in_the_new_tails_shapes(
        tmp_path, resize, hidden_size, up_proj_dtype, weight_layout):
    from_tp, to_tp = resize
    config = dataclasses.replace(CONFIG, hidden_size=hidden_size, up_proj_dtype=up_proj_dtype)
    tail = saved_tail(config, from_tp, weight_layout)
    restored = k3_tail.LatentMoETail.restore(save(tail, tmp_path / "tail"), config=config, mesh=make_tp_mesh(to_tp),
                                             weight_layout=weight_layout)
    built = nnx.state(nnx.eval_shape(lambda: k3_tail.LatentMoETail(config, make_tp_mesh(to_tp), rngs=nnx.Rngs(0),
                                                                   weight_layout=weight_layout)))
    state = nnx.state(restored)
    assert set(state) == set(built)
    for name in state:
        value, expected = state[name].get_value(), built[name].get_value()
        assert (value.shape, value.dtype) == (expected.shape, expected.dtype)
        assert value.sharding.spec == expected.sharding.spec and value.sharding.mesh == make_tp_mesh(to_tp)
        saved = np.asarray(getattr(tail, name)[...])
        np.testing.assert_array_equal(bits(value)[..., :hidden_size], bits(saved)[..., :hidden_size])
        np.testing.assert_array_equal(bits(value)[..., hidden_size:], 0)


@pytest.mark.parametrize(("from_tp", "to_tp", "weight_layout", "up_proj_dtype"), [
    pytest.param(4, 8, "column", None, id="4to8-column-bf16"),
    pytest.param(8, 2, "column", FP8, id="8to2-column-fp8"),
    pytest.param(4, 8, "replicated", FP8, id="4to8-replicated-fp8"),
    pytest.param(8, 2, "replicated", None, id="8to2-replicated-bf16"),
])
def test_restored_tail_computes_the_saved_tails_y(tmp_path, from_tp, to_tp, weight_layout, up_proj_dtype):
    config = dataclasses.replace(CONFIG, up_proj_dtype=up_proj_dtype)
    tail = saved_tail(config, from_tp, weight_layout)
    restored = k3_tail.LatentMoETail.restore(save(tail, tmp_path / "tail"), config=config, mesh=make_tp_mesh(to_tp),
                                             weight_layout=weight_layout)
    y = tail(*first_rank_inputs(config, from_tp))
    assert relative_error(restored(*first_rank_inputs(config, to_tp)), y) <= TOLERANCE[config.dtype]


@pytest.mark.parametrize("form", ["nnx.State", "orbax's dict", "pure dict"])
def test_a_state_in_memory_restores_in_each_form_it_comes_in(tmp_path, form):
    tail = saved_tail(CONFIG, 4)
    state = {"nnx.State": lambda: nnx.state(tail),
             "orbax's dict": lambda: restored_without_target(save(tail, tmp_path / "tail")),
             "pure dict": lambda: nnx.to_pure_dict(nnx.state(tail))}[form]()
    restored = k3_tail.LatentMoETail.restore(state, config=CONFIG, mesh=make_tp_mesh(8))
    assert restored.up_proj_kernel[...].shape == (64, 104)
    np.testing.assert_array_equal(bits(restored.up_proj_kernel[...])[:, :100], bits(tail.up_proj_kernel[...]))


def test_restore_tail_state_updates_the_tail_of_a_model():
    """The state for ``nnx.update`` of a tail built at p' inside a model of the caller's."""

    class Model(nnx.Module):
        def __init__(self, tp_size):
            self.tail = k3_tail.LatentMoETail(CONFIG, make_tp_mesh(tp_size), rngs=nnx.Rngs(1))

    saved = saved_tail(CONFIG, 4)
    model = Model(8)
    nnx.update(model.tail, restore_tail_state(nnx.state(saved), config=CONFIG, mesh=make_tp_mesh(8)))
    np.testing.assert_array_equal(bits(model.tail.up_proj_kernel[...])[:, :100], bits(saved.up_proj_kernel[...]))
    np.testing.assert_array_equal(bits(model.tail.norm_scale[...]), bits(saved.norm_scale[...]))


def test_restore_tail_state_merges_with_the_graphdef_of_a_tail_of_p_prime_ranks():
    saved = saved_tail(CONFIG, 4)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: k3_tail.LatentMoETail(CONFIG, make_tp_mesh(8), rngs=nnx.Rngs(0))))
    tail = nnx.merge(graphdef, restore_tail_state(nnx.state(saved), config=CONFIG, mesh=make_tp_mesh(8)))
    assert tail.tp_size == 8 and tail.up_proj_kernel[...].shape == (64, 104)
    np.testing.assert_array_equal(bits(tail.up_proj_kernel[...])[:, :100], bits(saved.up_proj_kernel[...]))


@pytest.mark.parametrize(("saved_layout", "weight_layout"), [("column", "replicated"), ("replicated", "column")])
def test_a_state_saved_in_one_layout_restores_in_the_other(tmp_path, saved_layout, weight_layout):
    tail = saved_tail(CONFIG, 8, saved_layout)
    restored = k3_tail.LatentMoETail.restore(save(tail, tmp_path / "tail"), config=CONFIG, mesh=make_tp_mesh(4),
                                             weight_layout=weight_layout)
    kernel = restored.up_proj_kernel[...]
    assert kernel.shape == (64, 100) and kernel.sharding.is_fully_replicated == (weight_layout == "replicated")
    np.testing.assert_array_equal(bits(kernel), bits(tail.up_proj_kernel[...])[:, :100])


def with_padding(tail, name, value):
    """``tail``'s state with ``value`` written into the first padding column of its parameter ``name``."""
    state = nnx.to_pure_dict(nnx.state(tail))
    array = np.asarray(state[name]).copy()
    array[..., tail.config.hidden_size] = value
    state[name] = array
    return state


@pytest.mark.parametrize("value", [1.0, np.nan], ids=["one", "nan"])
@pytest.mark.parametrize("name", ["up_proj_kernel", "up_proj_scale"])
def test_nonzero_padding_is_refused(name, value):
    config = dataclasses.replace(CONFIG, up_proj_dtype=FP8)
    state = with_padding(saved_tail(config, 8), name, value)
    with pytest.raises(ValueError, match=rf"^checkpoint: {name}: its columns from H = 100 .* nonzero values"):
        restore_tail_state(state, config=config, mesh=make_tp_mesh(4))


def test_nonzero_padding_in_a_directory_is_refused(tmp_path):
    tail = saved_tail(CONFIG, 8)
    tail.up_proj_kernel.set_value(jax.device_put(jnp.ones((64, 104), CONFIG.dtype), tail.up_proj_kernel[...].sharding))
    with pytest.raises(ValueError, match=r"^checkpoint: up_proj_kernel: its columns from H = 100 .* padding"):
        k3_tail.LatentMoETail.restore(save(tail, tmp_path / "tail"), config=CONFIG, mesh=make_tp_mesh(2))


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_size": 104}, r"^checkpoint: up_proj_kernel: 100 columns, fewer than H = 104"),
    ({"hidden_size": 96}, r"^checkpoint: up_proj_kernel: its columns from H = 96 .* padding"),
    ({"latent_size": 32}, r"^checkpoint: up_proj_kernel: expected \[L, Hs\] with L = 32"),
    ({"dtype": jnp.float32}, r"^checkpoint: up_proj_kernel: expected dtype float32 \(config.dtype\), got bfloat16"),
    ({"up_proj_dtype": FP8}, r"^checkpoint: no up_proj_scale, which a tail of config.up_proj_dtype = float8_e4m3fn"),
    ({"use_latent_norm": False}, r"^checkpoint: norm_scale: saved, but a tail of config.use_latent_norm = False"),
])
def test_a_state_of_another_tail_is_refused(tmp_path, change, message):
    directory = save(saved_tail(CONFIG, 4), tmp_path / "tail")
    with pytest.raises(ValueError, match=message):
        k3_tail.LatentMoETail.restore(directory, config=dataclasses.replace(CONFIG, **change), mesh=make_tp_mesh(8))


def test_a_models_whole_state_is_refused_for_the_tails():
    state = {"tail": nnx.to_pure_dict(nnx.state(saved_tail(CONFIG, 4)))}
    with pytest.raises(ValueError, match=r"^checkpoint: 'tail': no entry of a LatentMoETail's state"):
        restore_tail_state(state, config=CONFIG, mesh=make_tp_mesh(8))


@pytest.mark.parametrize(("checkpoint", "message"), [
    (42, r"^checkpoint: expected an orbax checkpoint directory or a LatentMoETail's nnx.State, got int"),
    ([1, 2], r"^checkpoint: expected an orbax checkpoint directory or a LatentMoETail's nnx.State, got list"),
    ("", r"^checkpoint: expected an orbax checkpoint directory, got ''"),
    ("/nonexistent/tail", r"^checkpoint: '/nonexistent/tail' is no directory"),
])
def test_a_checkpoint_of_the_wrong_kind_is_refused(checkpoint, message):
    with pytest.raises(ValueError, match=message):
        k3_tail.LatentMoETail.restore(checkpoint, config=CONFIG, mesh=make_tp_mesh(8))


def test_an_abstract_state_is_refused():
    abstract = nnx.state(nnx.eval_shape(lambda: k3_tail.LatentMoETail(CONFIG, make_tp_mesh(4), rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"^checkpoint: norm_scale: expected an array \(numpy or jax\), got Shape"):
        restore_tail_state(abstract, config=CONFIG, mesh=make_tp_mesh(8))


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^checkpoint: '.*': no orbax checkpoint of a tree there"):
        restore_tail_state(tmp_path, config=CONFIG, mesh=make_tp_mesh(8))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"config": "config"}, r"^config: expected a k3_tail.TailConfig, got str"),
    ({"mesh": None}, r"^mesh: expected a jax.sharding.Mesh, got NoneType"),
    ({"axis_name": "model"}, r"^mesh: expected a mesh axis named 'model'"),
    ({"weight_layout": "rows"}, r"^weight_layout: expected"),
])
@pytest.mark.parametrize("restore", [k3_tail.LatentMoETail.restore, restore_tail_state], ids=["restore", "function"])
def test_bad_arguments_are_refused_before_the_checkpoint_is_read(restore, kwargs, message):
    # A checkpoint that is not there: the argument is refused before anything is read.
    arguments = {"config": CONFIG, "mesh": make_tp_mesh(8), **kwargs}
    with pytest.raises(ValueError, match=message):
        restore("/nonexistent/tail", **arguments)


def test_a_tp_axis_of_two_mesh_axes_takes_the_state(tmp_path):
    tail = saved_tail(CONFIG, 4)
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    restored = k3_tail.LatentMoETail.restore(save(tail, tmp_path / "tail"), config=CONFIG, mesh=mesh,
                                             axis_name=("x", "y"))
    kernel = restored.up_proj_kernel[...]
    assert kernel.shape == (64, 104) and kernel.sharding.spec == jax.sharding.PartitionSpec(None, ("x", "y"))
    np.testing.assert_array_equal(bits(kernel)[:, :100], bits(tail.up_proj_kernel[...]))


def test_a_relative_directory_is_the_one_under_the_working_directory(tmp_path, monkeypatch):
    tail = saved_tail(CONFIG, 4)
    save(tail, tmp_path / "tail")
    monkeypatch.chdir(tmp_path)
    restored = k3_tail.LatentMoETail.restore("tail", config=CONFIG, mesh=make_tp_mesh(8))
    np.testing.assert_array_equal(bits(restored.up_proj_kernel[...])[:, :100], bits(tail.up_proj_kernel[...]))


# --- The Kimi-K3 layer: its checkpoint values saved at p, restored at p' --------------------------------------------

def kimi_layer(tp_size, seed=0):
    """A small Kimi-K3 layer (H 224, L 112, 8 experts of width 96, shared width 192) in float32, p = tp_size."""
    config = LayerConfig.kimi_k3(num_experts=8, top_k=2, width_divisor=32, dtype="float32")
    return layer_module.build_layer(config, make_tp_mesh(tp_size), seed=seed)


def test_a_layer_saved_at_p_restores_at_p_prime_and_computes_the_same_y(tmp_path):
    saved_p, restored_p = 2, 8  # the packed input kernel's blocks: 2 of [H, E + L + F] saved, 8 of [H, E + L + F/4]
    saved = kimi_layer(saved_p)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "layer", saved.checkpoint_values())
    checkpointer.wait_until_finished()
    restored = restore_layer(tmp_path / "layer", config=saved.config, mesh=make_tp_mesh(restored_p))
    assert restored.tp_size == restored_p
    for name, value in restored.checkpoint_values().items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(saved.checkpoint_values()[name]), err_msg=name)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, saved.config.hidden_size)), jnp.float32)
    assert relative_error(restored(x), saved(x)) <= 1e-5


def test_a_layer_checkpoint_of_another_config_is_a_value_error_naming_the_entry():
    values = kimi_layer(2).checkpoint_values()
    config = LayerConfig.kimi_k3(num_experts=16, top_k=2, width_divisor=32, dtype="float32")
    with pytest.raises(ValueError, match=r"^checkpoint: expert_down: expected shape \(16, 96, 112\)"):
        restore_layer(values, config=config, mesh=make_tp_mesh(2))
