"""A Kimi-K3 layer saved at one TP size, restored at another: ``layer.checkpoint_values()`` hold no trace of p, and
:func:`restore_layer` builds the layer at any p' from them, each device reading only its block of every array.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from k3_tail.models.kimi_k3.layer import KimiK3MoELayer
from k3_tail.models.kimi_k3.layer_config import LayerConfig
from k3_tail.models.kimi_k3.parameters import layer_parameters, partition_specs


def restore_layer(checkpoint: str | os.PathLike | Mapping, *, config: LayerConfig, mesh: Mesh, axis_name: str = "tp",
                  weight_layout: str = "replicated") -> KimiK3MoELayer:
    """The layer whose ``checkpoint_values()`` were saved (at any p), on ``mesh`` (p' ranks along ``axis_name``).

    Args:
      checkpoint: the directory orbax's ``StandardCheckpointer`` saved ``layer.checkpoint_values()`` to, or those
        values in memory (a mapping of arrays).
      config, mesh, axis_name, weight_layout: as :class:`KimiK3MoELayer` takes them.

    Raises:
      ValueError: naming ``checkpoint`` for a path that is no orbax checkpoint, or a missing, unknown or mis-shaped
        entry (before any array is read); as :class:`KimiK3MoELayer` raises it for the rest.
    """
    expected = layer_parameters(config)
    specs = partition_specs(config, mesh.shape[axis_name], axis_name=axis_name, weight_layout=weight_layout)
    if isinstance(checkpoint, Mapping):
        _check_entries({name: (np.shape(value), getattr(value, "dtype", None)) for name, value in checkpoint.items()},
                       expected)
        return KimiK3MoELayer(config, mesh, checkpoint, axis_name=axis_name, weight_layout=weight_layout)
    if not isinstance(checkpoint, (str, os.PathLike)) or not os.path.isdir(checkpoint):
        raise ValueError(f"checkpoint: expected the orbax checkpoint directory of a layer's checkpoint_values() or "
                         f"those values, got {checkpoint!r}")
    import orbax.checkpoint as ocp  # the [orbax] extra, loaded for a restore from a directory only

    path = os.path.abspath(checkpoint)  # orbax finds no checkpoint at a relative path
    checkpointer = ocp.StandardCheckpointer()
    try:
        tree = getattr(checkpointer.metadata(path).item_metadata, "tree", None)
        if not isinstance(tree, Mapping):
            raise ValueError(f"checkpoint: {str(checkpoint)!r}: no orbax checkpoint of a tree there "
                             "(StandardCheckpointer().save(directory, layer.checkpoint_values()) writes one)")
        _check_entries({name: (tuple(entry.shape), entry.dtype) for name, entry in tree.items()}, expected)
        target = {name: jax.ShapeDtypeStruct(parameter.shape, parameter.dtype,
                                             sharding=NamedSharding(mesh, specs[name]))
                  for name, parameter in expected.items()}
        values = checkpointer.restore(path, target)
    finally:
        checkpointer.close()
    return KimiK3MoELayer(config, mesh, values, axis_name=axis_name, weight_layout=weight_layout)


def _check_entries(saved: Mapping[str, tuple], expected: Mapping) -> None:
    """ValueError naming ``checkpoint`` and the entry unless ``saved`` (name -> (shape, dtype)) is the layer's."""
    for name in sorted(set(saved) - set(expected)):
        raise ValueError(f"checkpoint: {name!r}: no array of the layer's checkpoint_values() (expected the names "
                         f"{sorted(expected)})")
    for name in sorted(set(expected) - set(saved)):
        raise ValueError(f"checkpoint: no {name!r}, which the layer's checkpoint_values() hold")
    for name, (shape, dtype) in saved.items():
        parameter = expected[name]
        if tuple(shape) != parameter.shape or dtype is None or np.dtype(dtype) != parameter.dtype:
            raise ValueError(f"checkpoint: {name}: expected shape {parameter.shape} of {parameter.dtype.name}, got "
                             f"{tuple(shape)} of {dtype}: a layer of another config")
