"""A Hugging Face model config (config.json) read for the tail: the fields, checked, and which layers are MoE.

Kimi-K3 wraps its text model's fields under ``text_config``; other models of the family keep them at the
top level. :func:`tail_fields` maps them to :class:`k3_tail.TailConfig` fields:

    hidden_size                 -> hidden_size (H)
    routed_expert_hidden_size   -> latent_size (L): required; a model without it has no latent MoE
    rms_norm_eps                -> rms_norm_eps
    routed_scaling_factor       -> routed_scaling_factor (1.0 when absent)
    latent_moe_use_norm         -> use_latent_norm
    torch_dtype (or dtype)      -> dtype: "bfloat16", "float16" or "float32" (the wrapper's when the
                                   text config has neither; TailConfig's default when none does)

A bad value is a ValueError naming the field as the config spells it (``text_config.rms_norm_eps``).
This module imports nothing from k3_tail, so that ``config.py`` can use it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
TEXT_CONFIG = "text_config"
# The dtypes the tail computes in, as a config.json names them ("torch.bfloat16" is accepted too).
TAIL_DTYPES = ("bfloat16", "float16", "float32")
_DTYPE_FIELDS = ("torch_dtype", "dtype")


def text_config(config: Any) -> dict[str, Any]:
    """The text model's config as a dict from ``config``: a path to a config.json, a directory holding one, or
    a mapping (the whole config or its text part); ``"_where"`` is "text_config." or "" (for messages) and
    ``"_wrapper"`` the wrapper's dtype fields. ValueError when the file is missing or not a JSON object."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / CONFIG_FILE
        if not path.is_file():
            raise ValueError(f"config: no {CONFIG_FILE} at {str(path)!r}")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"config: {str(path)!r} is not JSON ({error})") from None
    if not isinstance(config, Mapping):
        raise ValueError(f"config: expected a path to {CONFIG_FILE}, a checkpoint directory or a dict, "
                         f"got {type(config).__name__}")
    if TEXT_CONFIG in config:
        text = config[TEXT_CONFIG]
        if not isinstance(text, Mapping):
            raise ValueError(f"{TEXT_CONFIG}: expected a JSON object, got {type(text).__name__}")
        # A wrapper may give the dtype at its top level only: the text model's, unless it says otherwise.
        outer = {name: config[name] for name in _DTYPE_FIELDS if name in config}
        return {**text, "_where": f"{TEXT_CONFIG}.", "_wrapper": outer}
    return {"_wrapper": {}, **config, "_where": config.get("_where", "")}


def tail_fields(config: Any) -> dict[str, Any]:
    """The :class:`k3_tail.TailConfig` fields the model's config sets (module docstring), checked: ValueError
    naming the field when ``routed_expert_hidden_size`` or another required field is absent, or a value is
    one the tail cannot serve."""
    text = text_config(config)
    if text.get("routed_expert_hidden_size") is None:
        raise ValueError(f"{_name(text, 'routed_expert_hidden_size')}: missing: this model has no latent MoE "
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
    """``num_hidden_layers``: the decoder layers the model has."""
    return _integer(text_config(config), "num_hidden_layers", minimum=1)


def is_moe_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` has a MoE block: layer >= first_k_dense_replace (default 0) and
    (layer + 1) % moe_layer_freq == 0 (default 1). ValueError naming ``layer`` when it is not one of the
    model's ``num_hidden_layers`` layers."""
    text = text_config(config)
    count = _integer(text, "num_hidden_layers", minimum=1)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < count:
        raise ValueError(f"layer: expected a decoder layer 0..{count - 1} ({_name(text, 'num_hidden_layers')} "
                         f"= {count}), got {layer!r}")
    first = _integer(text, "first_k_dense_replace", minimum=0, default=0)
    frequency = _integer(text, "moe_layer_freq", minimum=1, default=1)
    return layer >= first and (layer + 1) % frequency == 0


def moe_layers(config: Any) -> tuple[int, ...]:
    """Every decoder layer that has a MoE block, in order (:func:`is_moe_layer`)."""
    text = text_config(config)
    return tuple(layer for layer in range(num_layers(text)) if is_moe_layer(text, layer))


def field(config: Any, name: str, *, minimum: int | None = None, default: Any = None) -> Any:
    """One field of the text config: an integer >= ``minimum`` when ``minimum`` is given (ValueError
    naming it otherwise), else the raw value; ``default`` when absent (ValueError when that is None)."""
    text = text_config(config)
    if minimum is not None:
        return _integer(text, name, minimum=minimum, default=default)
    return _get(text, name, default)


def field_name(config: Any, name: str) -> str:
    """``name`` as the config spells it, for messages: ``text_config.name`` when nested."""
    return _name(text_config(config), name)


def _name(text: Mapping[str, Any], name: str) -> str:
    return f"{text['_where']}{name}"


def _get(text: Mapping[str, Any], name: str, default: Any = None) -> Any:
    value = text.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"{_name(text, name)}: missing from the model's config")
        return default
    return value


def _integer(text: Mapping[str, Any], name: str, *, minimum: int, default: int | None = None) -> int:
    value = _get(text, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_name(text, name)}: expected an integer >= {minimum}, got {value!r}")
    return value


def _number(text: Mapping[str, Any], name: str, *, positive: bool = False, default: float | None = None) -> float:
    value = _get(text, name, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (positive and value <= 0)):
        wanted = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{_name(text, name)}: expected {wanted}, got {value!r}")
    return float(value)


def _boolean(text: Mapping[str, Any], name: str) -> bool:
    value = _get(text, name)
    if not isinstance(value, bool):
        raise ValueError(f"{_name(text, name)}: expected true or false, got {value!r}")
    return value


def _dtype(text: Mapping[str, Any]) -> str | None:
    """The dtype the config names (``torch_dtype``, else ``dtype``; the text config's, else the wrapper's)
    as one of TAIL_DTYPES, or None when it names none."""
    for fields, where in ((text, text["_where"]), (text["_wrapper"], "")):
        for name in _DTYPE_FIELDS:
            value = fields.get(name)
            if value is None:
                continue
            spelled = value.removeprefix("torch.") if isinstance(value, str) else value
            if spelled not in TAIL_DTYPES:
                raise ValueError(f"{where}{name}: expected one of {TAIL_DTYPES}, got {value!r}")
            return spelled
    return None
