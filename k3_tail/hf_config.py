"""A Hugging Face model config (config.json) read for the tail: the fields, checked, and which layers are MoE.

The text model's fields (under ``text_config`` in Kimi-K3's, at the top level in others) map to
:class:`k3_tail.TailConfig` fields (:func:`tail_fields`):

    hidden_size                 -> hidden_size (H)
    routed_expert_hidden_size   -> latent_size (L): required; a model without it has no latent MoE
    rms_norm_eps                -> rms_norm_eps
    routed_scaling_factor       -> routed_scaling_factor (1.0 when absent)
    latent_moe_use_norm         -> use_latent_norm
    torch_dtype (or dtype)      -> dtype: "bfloat16", "float16" or "float32" (the wrapper's when the
                                   text config has neither; TailConfig's default when none does; both
                                   given must agree)

Decoder layer i is MoE when ``i >= first_k_dense_replace`` (default 0) and ``i % moe_layer_freq == 0``
(default 1), as the reference code, vLLM and SGLang build it; a config with MoE layers must give ``num_experts``.

The file is strict JSON (:func:`k3_tail.json_files.read_json`). A bad value is a ValueError naming the field as
the config spells it (``text_config.rms_norm_eps``). The fields are kept apart from where they came from
(:class:`TextConfig`), so no key of the file is taken for anything but a field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from k3_tail._checks import check_path
from k3_tail.json_files import read_json

CONFIG_FILE = "config.json"
TEXT_CONFIG = "text_config"
# The dtypes the tail computes in, as a config.json names them ("torch.bfloat16" is accepted too).
TAIL_DTYPES = ("bfloat16", "float16", "float32")
_DTYPE_FIELDS = ("torch_dtype", "dtype")
# A wrapper's fields that serve its text config when that has none of its own (compressed-tensors writes
# ``quantization_config`` at the top level; Kimi-K3's release has it under ``text_config``).
WRAPPER_FIELDS = (*_DTYPE_FIELDS, "quantization_config")
# The most decoder layers a config may have: the largest length a Python range reports (moe_layers).
MAX_LAYERS = sys.maxsize


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The text model's part of a model config: its ``fields``; ``where`` they sit ("text_config." or "", for
    messages); the ``wrapper``'s fields that serve it (:data:`WRAPPER_FIELDS`)."""

    fields: Mapping[str, Any]
    where: str = ""
    wrapper: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        """Field ``name``, or ``default`` when absent."""
        return self.fields.get(name, default)

    def name(self, field: str) -> str:
        """``field`` as the config spells it, for messages: ``text_config.field`` when nested."""
        return f"{self.where}{field}"

    def inherited(self, field: str) -> tuple[Any, str]:
        """(the value, its name as the config spells it) of ``field``: the text config's, else the wrapper's."""
        if field not in self.fields and field in self.wrapper:
            return self.wrapper[field], field
        return self.fields.get(field), self.name(field)


def config_file(path: str | os.PathLike) -> Path:
    """The config.json that ``path`` stands for: itself, the one in a checkpoint directory, or the one beside a
    ``.safetensors`` file. ValueError for a path no file can have or when that file does not exist."""
    given = Path(check_path("config", path, expected=f"a path to {CONFIG_FILE}, a checkpoint directory or a "
                                                     ".safetensors file"))
    file, beside = given, ""
    if given.is_dir():
        file = given / CONFIG_FILE
    elif given.suffix == ".safetensors":
        file, beside = given.with_name(CONFIG_FILE), f" (beside the checkpoint file {str(given)!r})"
    if not file.exists():
        raise ValueError(f"config: no {CONFIG_FILE} at {str(file)!r}{beside}")
    return file


def text_config(config: Any) -> TextConfig:
    """The text model's config from a path (:func:`config_file`), a mapping or a :class:`TextConfig`. ValueError
    when the file cannot be read or is no JSON object, or ``config`` is none of these."""
    if isinstance(config, TextConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        file = config_file(config)
        config = read_json(file, what="config")
        if not isinstance(config, Mapping):
            raise ValueError(f"config: {str(file)!r} holds a JSON {type(config).__name__}, not an object")
    if not isinstance(config, Mapping):
        raise ValueError(f"config: expected a path to {CONFIG_FILE}, a checkpoint directory or a .safetensors "
                         f"file, or the config as a dict, got {type(config).__name__}")
    if TEXT_CONFIG not in config:
        return TextConfig(config)
    text = config[TEXT_CONFIG]
    if not isinstance(text, Mapping):
        raise ValueError(f"{TEXT_CONFIG}: expected a JSON object, got {type(text).__name__}")
    wrapper = {name: config[name] for name in WRAPPER_FIELDS if name in config}
    return TextConfig(text, f"{TEXT_CONFIG}.", wrapper)


def tail_fields(config: Any) -> dict[str, Any]:
    """The :class:`k3_tail.TailConfig` fields the model's config sets (module docstring); ValueError naming the
    field when a required one is absent or the tail cannot serve its value."""
    text = text_config(config)
    if text.get("routed_expert_hidden_size") is None:
        raise ValueError(f"{text.name('routed_expert_hidden_size')}: missing: this model has no latent MoE "
                         "(its routed experts work in the hidden size), so it has no latent MoE tail")
    fields = {
        "hidden_size": _integer(text, "hidden_size", minimum=1),
        "latent_size": _integer(text, "routed_expert_hidden_size", minimum=1),
        "rms_norm_eps": _number(text, "rms_norm_eps", positive=True),
        "routed_scaling_factor": _number(text, "routed_scaling_factor", default=1.0),
        "use_latent_norm": _boolean(text, "latent_moe_use_norm"),
    }
    dtype = _dtype(text)
    if dtype is not None:
        fields["dtype"] = dtype
    return fields


def num_layers(config: Any) -> int:
    """``num_hidden_layers``: the decoder layers the model has (at most ``MAX_LAYERS``)."""
    text = text_config(config)
    count = _integer(text, "num_hidden_layers", minimum=1)
    if count > MAX_LAYERS:
        raise ValueError(f"{text.name('num_hidden_layers')}: expected at most {MAX_LAYERS} layers (the largest "
                         f"length of a Python range), got {count}")
    return count


def is_moe_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` has a MoE block (module docstring). ValueError naming ``layer`` outside
    the model's layers, or ``num_experts`` when a MoE layer has no expert count."""
    text = text_config(config)
    count = num_layers(text)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < count:
        raise ValueError(f"layer: expected a decoder layer 0..{count - 1} ({text.name('num_hidden_layers')} "
                         f"= {count}), got {layer!r}")
    first, frequency = _moe_rule(text)
    moe = layer >= first and layer % frequency == 0
    if moe:
        _num_experts(text)
    return moe


def moe_layers(config: Any) -> range:
    """Every decoder layer that has a MoE block, as a range (Kimi-K3: ``range(1, 93)``)."""
    text = text_config(config)
    count = num_layers(text)
    first, frequency = _moe_rule(text)
    layers = range(-(-first // frequency) * frequency, count, frequency)  # the first multiple of f >= first
    if layers:
        _num_experts(text)
    return layers


def field(config: Any, name: str, *, minimum: int | None = None, default: Any = None) -> Any:
    """One field of the text config, an integer >= ``minimum`` when given; ``default`` when absent. ValueError
    naming it otherwise, or when absent without a default."""
    text = text_config(config)
    if minimum is not None:
        return _integer(text, name, minimum=minimum, default=default)
    return _get(text, name, default)


def field_name(config: Any, name: str) -> str:
    """``name`` as the config spells it, for messages: ``text_config.name`` when nested."""
    return text_config(config).name(name)


def _moe_rule(text: TextConfig) -> tuple[int, int]:
    return (_integer(text, "first_k_dense_replace", minimum=0, default=0),
            _integer(text, "moe_layer_freq", minimum=1, default=1))


def _num_experts(text: TextConfig) -> int:
    if text.get("num_experts") is None:
        raise ValueError(f"{text.name('num_experts')}: missing from the model's config, which has MoE layers "
                         f"(first_k_dense_replace, moe_layer_freq): their routed experts need a count")
    return _integer(text, "num_experts", minimum=1)


def _get(text: TextConfig, name: str, default: Any = None) -> Any:
    value = text.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"{text.name(name)}: missing from the model's config")
        return default
    return value


def _integer(text: TextConfig, name: str, *, minimum: int, default: int | None = None) -> int:
    value = _get(text, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{text.name(name)}: expected an integer >= {minimum}, got {value!r}")
    return value


def _number(text: TextConfig, name: str, *, positive: bool = False, default: float | None = None) -> float:
    value = _get(text, name, default)
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float64
            number = math.inf
    if not math.isfinite(number) or (positive and number <= 0):
        wanted = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{text.name(name)}: expected {wanted}, got {value!r}")
    return number


def _boolean(text: TextConfig, name: str) -> bool:
    value = _get(text, name)
    if not isinstance(value, bool):
        raise ValueError(f"{text.name(name)}: expected true or false, got {value!r}")
    return value


def _dtype(text: TextConfig) -> str | None:
    """The dtype the config names (``torch_dtype`` or ``dtype``; the text config's, else the wrapper's), or None.
    ValueError naming both fields when one level gives two that differ."""
    for fields, where in ((text.fields, text.where), (text.wrapper, "")):
        named = {}
        for name in _DTYPE_FIELDS:
            value = fields.get(name)
            if value is None:
                continue
            spelled = value.removeprefix("torch.") if isinstance(value, str) else value
            if spelled not in TAIL_DTYPES:
                raise ValueError(f"{where}{name}: expected one of {TAIL_DTYPES}, got {value!r}")
            named[name] = spelled
        if len(set(named.values())) > 1:
            raise ValueError(f"{where}{_DTYPE_FIELDS[0]} and {where}{_DTYPE_FIELDS[1]}: they name different dtypes, "
                             f"{fields[_DTYPE_FIELDS[0]]!r} and {fields[_DTYPE_FIELDS[1]]!r}; give one, or the same")
        if named:
            return next(iter(named.values()))
    return None
