"""Hugging Face's names of a checkpoint's decoder layers: where they sit, their numbers (decimal without leading
zeros), their blocks (a MoE layer's ``block_sparse_moe``; a dense layer's ``mlp``, which has no tail).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from k3_tail._checks import check_int
from k3_tail.checkpoint.files import TensorFiles

# Where the text model's decoder layers sit: Kimi-K3's multimodal wrapper, the same as vLLM and SGLang accept it,
# a text-only model of the family.
LAYER_PREFIXES = ("language_model.model.layers.", "language_model.layers.", "model.layers.")
MOE_BLOCK, DENSE_BLOCK = "block_sparse_moe", "mlp"
# A layer index has at most this many digits (every int64 of fewer digits is a layer number).
_MAX_LAYER_DIGITS = 18


class Checkpoint(TensorFiles):
    """A Hugging Face checkpoint opened for reading: its files (:class:`TensorFiles`) and its decoder layers.

    Args:
      path: as :class:`TensorFiles` takes it.

    Raises:
      ValueError: as :class:`TensorFiles` raises it; for a malformed layer index, or decoder layers under none or
        two of the prefixes.
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.layers_prefix = _layers_prefix(self.names)
        self._layers = _layer_names(self.names, self.layers_prefix)

    @property
    def layers(self) -> tuple[int, ...]:
        """The decoder layers the checkpoint holds tensors for, in order."""
        return tuple(sorted(self._layers))

    def layer_prefix(self, layer: int) -> str:
        """The names' prefix of decoder layer ``layer``: ``layers_prefix`` and N ("model.layers.5.")."""
        return f"{self.layers_prefix}{layer}."

    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose tensors include a ``block_sparse_moe`` block."""
        return tuple(layer for layer in self.layers if _has_block(self._layers[layer], self.layer_prefix(layer)))

    def moe_block(self, layer: int) -> str:
        """The names' prefix of layer ``layer``'s MoE block ("...layers.N.block_sparse_moe.").

        Raises:
          ValueError: naming the layer when it is not an integer >= 0, is past the last layer, has no
            tensors, or is a dense layer.
        """
        layer = check_int("layer", layer, minimum=0)
        layers = self.layers
        if layer not in self._layers:
            if not layers or layer > layers[-1]:
                last = f"layers 0..{layers[-1]}" if layers else "no decoder layers"
                raise ValueError(f"layer {layer}: past the last layer: the checkpoint has {last}")
            raise ValueError(f"layer {layer}: the checkpoint has no tensors under {self.layer_prefix(layer)!r}")
        if not _has_block(self._layers[layer], self.layer_prefix(layer)):
            raise ValueError(f"layer {layer}: a dense layer (its feed-forward block is {DENSE_BLOCK!r}, not "
                             f"{MOE_BLOCK!r}): it has no latent MoE tail; the MoE layers here are "
                             f"{_ranges(self.moe_layers())}")
        return f"{self.layer_prefix(layer)}{MOE_BLOCK}."


def open_checkpoint(checkpoint: str | os.PathLike | Checkpoint) -> Checkpoint:
    """``checkpoint`` when it already is a :class:`Checkpoint`, else the checkpoint at that path."""
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)


def _layers_prefix(names: Sequence[str]) -> str:
    """The one of LAYER_PREFIXES the checkpoint's decoder layers sit under; ValueError for none or several."""
    found = [prefix for prefix in LAYER_PREFIXES if any(name.startswith(prefix) for name in names)]
    if not found:
        named = " or ".join(f"{prefix}N.*" for prefix in LAYER_PREFIXES)
        raise ValueError(f"checkpoint: no decoder layers: no tensor named {named}")
    if len(found) > 1:
        raise ValueError(f"checkpoint: decoder layers under {' and '.join(found)}: which are the text model's is "
                         "ambiguous")
    return found[0]


def _layer_names(names: Sequence[str], prefix: str) -> dict[int, list[str]]:
    """layer -> the names under ``prefix`` N.; ValueError naming a tensor whose N is not written as one."""
    layers: dict[int, list[str]] = {}
    for name in names:
        if not name.startswith(prefix):
            continue
        number, dot, _ = name[len(prefix):].partition(".")
        canonical = number.isascii() and number.isdigit() and (number == "0" or not number.startswith("0"))
        if not dot or not canonical or len(number) > _MAX_LAYER_DIGITS:
            raise ValueError(f"checkpoint: {name}: {prefix}{number}{dot} is no decoder layer: a layer index is "
                             f"written in decimal without leading zeros ({prefix}1.), of at most "
                             f"{_MAX_LAYER_DIGITS} digits")
        layers.setdefault(int(number), []).append(name)
    return layers


def _has_block(names: Sequence[str], layer_prefix: str) -> bool:
    return any(name.startswith(f"{layer_prefix}{MOE_BLOCK}.") for name in names)


def _ranges(layers: Sequence[int]) -> str:
    """"1..5, 7" for layers 1, 2, 3, 4, 5, 7 ("none" when empty)."""
    if not layers:
        return "none"
    runs, first, last = [], layers[0], layers[0]
    for layer in layers[1:]:
        if layer == last + 1:
            last = layer
            continue
        runs.append((first, last))
        first = last = layer
    runs.append((first, last))
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)
