"""Tiny Hugging Face checkpoints in Kimi-K3's layout, written by the tests (safetensors' own writer).

:func:`tiny_model` makes a model's config.json (``text_config`` inside a multimodal wrapper, as
Kimi-K3's) and its tensors in torch's layout ([out, in] Linear weights): layer 0 dense (``mlp``), the
others MoE (``block_sparse_moe``), attention and layer norms beside them, the embedding, the final norm
and the LM head, and a few vision tensors to be skipped. :func:`write_checkpoint` writes them as several
safetensors shards with a ``model.safetensors.index.json`` (or as one file), with the wrapper's
``language_model.`` prefix or unprefixed. :func:`moe_layer_weights` gives an MoE layer's weights as the Kimi-K3
layer names them. :func:`record_reads` records what the loaders read, and
:func:`record_slices` what safetensors copied for them.
"""

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from k3_tail.checkpoint import Checkpoint, files as checkpoint_files

WRAPPER = "language_model."
VISION_TENSORS = ("vision_tower.patch_embed.proj.weight", "vision_tower.blocks.0.attn.qkv.weight",
                  "multi_modal_projector.linear_1.weight")
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """The sizes of a tiny Kimi-K3-like model (torch names in the comments)."""

    hidden_size: int = 20                # hidden_size (H)
    latent_size: int = 8                 # routed_expert_hidden_size (L)
    num_layers: int = 3                  # num_hidden_layers; layer 0 dense (first_k_dense_replace 1)
    num_experts: int = 4                 # num_experts (E)
    top_k: int = 2                       # num_experts_per_token
    expert_width: int = 8                # moe_intermediate_size (m)
    num_shared_experts: int = 2          # num_shared_experts: one MLP of width F = 2 m
    dense_width: int = 12                # the dense layer's intermediate_size
    dtype: str = "bfloat16"
    rms_norm_eps: float = 1e-5
    routed_scaling_factor: float = 2.5

    @property
    def shared_width(self) -> int:
        return self.num_shared_experts * self.expert_width

    def text_config(self) -> dict:
        return {
            "model_type": "kimi_k3", "hidden_size": self.hidden_size, "routed_expert_hidden_size": self.latent_size,
            "latent_moe_use_norm": True, "rms_norm_eps": self.rms_norm_eps,
            "routed_scaling_factor": self.routed_scaling_factor, "num_hidden_layers": self.num_layers,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": self.num_experts,
            "num_experts_per_token": self.top_k, "moe_intermediate_size": self.expert_width,
            "num_shared_experts": self.num_shared_experts, "intermediate_size": self.dense_width,
            "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "moe_renormalize": True, "topk_method": "noaux_tc", "torch_dtype": self.dtype,
        }

    def config(self) -> dict:
        """The wrapper's config.json: the text model's fields under ``text_config``."""
        return {"model_type": "kimi_k3_vl", "architectures": ["KimiK3ForConditionalGeneration"],
                "text_config": self.text_config(), "vision_config": {"hidden_size": 6}}


def tiny_model(model: TinyModel = TinyModel(), *, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the model by its unprefixed name (``model.layers.N....``, ``vision_tower...``), in
    torch's layout and the model's dtype (the correction bias float32)."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(model.dtype)
    h, lat, m, f = model.hidden_size, model.latent_size, model.expert_width, model.shared_width

    def weight(*shape, mean=0.0):
        return (mean + rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(dtype)

    tensors = {"model.embed_tokens.weight": weight(32, h), "model.norm.weight": weight(h, mean=1.0),
               "lm_head.weight": weight(32, h)}
    for layer in range(model.num_layers):
        at = f"model.layers.{layer}."
        tensors.update({f"{at}input_layernorm.weight": weight(h, mean=1.0),
                        f"{at}post_attention_layernorm.weight": weight(h, mean=1.0),
                        f"{at}self_attn.q_proj.weight": weight(h, h), f"{at}self_attn.o_proj.weight": weight(h, h)})
        if layer == 0:
            tensors.update({f"{at}mlp.gate_proj.weight": weight(model.dense_width, h),
                            f"{at}mlp.up_proj.weight": weight(model.dense_width, h),
                            f"{at}mlp.down_proj.weight": weight(h, model.dense_width)})
            continue
        moe = f"{at}block_sparse_moe."
        tensors.update({
            f"{moe}gate.weight": weight(model.num_experts, h),
            f"{moe}gate.e_score_correction_bias": (0.1 * rng.standard_normal(model.num_experts)).astype(np.float32),
            f"{moe}routed_expert_down_proj.weight": weight(lat, h),
            f"{moe}routed_expert_up_proj.weight": weight(h, lat),
            f"{moe}routed_expert_norm.weight": weight(lat, mean=1.0),
            f"{moe}shared_experts.gate_proj.weight": weight(f, h),
            f"{moe}shared_experts.up_proj.weight": weight(f, h),
            f"{moe}shared_experts.down_proj.weight": weight(h, f),
        })
        for expert in range(model.num_experts):
            tensors.update({f"{moe}experts.{expert}.w1.weight": weight(m, lat),
                            f"{moe}experts.{expert}.w2.weight": weight(lat, m),
                            f"{moe}experts.{expert}.w3.weight": weight(m, lat)})
    tensors.update({name: weight(4, 6) for name in VISION_TENSORS})
    return tensors


def moe_layer_weights(tensors: dict[str, np.ndarray], layer: int, num_experts: int) -> dict[str, np.ndarray]:
    """MoE layer ``layer``'s weights by the Kimi-K3 layer's parameter names, from the torch-layout ``tensors``
    (each Linear weight transposed, the experts stacked): what a loader should make of them, independent of it."""
    moe = f"model.layers.{layer}.block_sparse_moe."

    def experts(weight):
        return np.stack([tensors[f"{moe}experts.{e}.{weight}.weight"].T for e in range(num_experts)])

    return {
        "router_kernel": tensors[moe + "gate.weight"].T, "router_bias": tensors[moe + "gate.e_score_correction_bias"],
        "down_proj": tensors[moe + "routed_expert_down_proj.weight"].T,
        "expert_gate": experts("w1"), "expert_up": experts("w3"), "expert_down": experts("w2"),
        "shared_gate": tensors[moe + "shared_experts.gate_proj.weight"].T,
        "shared_up": tensors[moe + "shared_experts.up_proj.weight"].T,
        "shared_down": tensors[moe + "shared_experts.down_proj.weight"].T,
        "norm_scale": tensors[moe + "routed_expert_norm.weight"],
        "up_proj_kernel": tensors[moe + "routed_expert_up_proj.weight"].T,
    }


def stored_name(name: str, wrapped: bool) -> str:
    """``name`` as the checkpoint stores it: the text model's under ``language_model.`` when ``wrapped``."""
    return WRAPPER + name if wrapped and not name.startswith(VISION_PREFIXES) else name


def write_checkpoint(directory: Path, tensors: dict[str, np.ndarray], *, config: dict | None = None,
                     wrapped: bool = True, shards: int = 3, single_file: str | None = None) -> Path:
    """Write ``tensors`` (unprefixed names) into ``directory`` and return the path to load from.

    ``shards`` > 0: that many shards, the tensors dealt out round-robin (so a layer spans several), with
    ``model.safetensors.index.json``; returns the directory. ``single_file``: one file of that name
    instead, no index; returns the file's path. ``config``: written as config.json when given.
    """
    directory.mkdir(parents=True, exist_ok=True)
    named = {stored_name(name, wrapped): np.ascontiguousarray(value) for name, value in tensors.items()}
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    if single_file is not None:
        save_file(named, str(directory / single_file))
        return directory / single_file
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts = [{} for _ in files]
    weight_map = {}
    for position, (name, value) in enumerate(named.items()):
        parts[position % shards][name] = value
        weight_map[name] = files[position % shards]
    for file, part in zip(files, parts, strict=True):
        save_file(part, str(directory / file))
    total = sum(value.nbytes for value in named.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def record_reads(monkeypatch) -> list[tuple[str, tuple[slice, ...], int]]:
    """A list that every ``Checkpoint.read`` from now on (for the test) appends (tensor name, index, bytes
    returned) to: what each device's callback read."""
    calls = []
    read = Checkpoint.read

    def recording(self, name, index=()):
        block = read(self, name, index)
        calls.append((name, tuple(index), block.nbytes))
        return block

    monkeypatch.setattr(Checkpoint, "read", recording)
    return calls


def record_slices(monkeypatch) -> list[tuple[str, tuple[slice, ...], int]]:
    """A list that every slice k3_tail.checkpoint asks safetensors for from now on (for the test) appends
    (tensor name, index, bytes returned) to: what safetensors copied out of the files."""
    calls = []
    open_file = checkpoint_files.safe_open

    class RecordingSlice:
        def __init__(self, name, tensor):
            self._name, self._tensor = name, tensor

        def get_dtype(self):
            return self._tensor.get_dtype()

        def get_shape(self):
            return self._tensor.get_shape()

        def __getitem__(self, index):
            block = self._tensor[index]
            calls.append((self._name, tuple(index), block.nbytes))
            return block

    class RecordingFile:
        def __init__(self, handle):
            self._handle = handle

        def offset_keys(self):
            return self._handle.offset_keys()

        def get_slice(self, name):
            return RecordingSlice(name, self._handle.get_slice(name))

    monkeypatch.setattr(checkpoint_files, "safe_open",
                        lambda path, framework: RecordingFile(open_file(path, framework=framework)))
    return calls
