"""The tail's weights from a Hugging Face checkpoint, each device reading only its own block.

Three modules, by what each reads: :mod:`~k3_tail.checkpoint.files` (the safetensors files: shards, the
index, and the checks that each file is the one opened and lies in the checkpoint's directory),
:mod:`~k3_tail.checkpoint.naming` (Hugging Face's decoder layer names: :class:`Checkpoint`) and
:mod:`~k3_tail.checkpoint.tail_weights` (the tail's own tensors: :func:`load_tail_weights`). A fourth
restores a tail's own saved ``nnx.state`` at another TP size: :mod:`~k3_tail.checkpoint.tail_state`
(:func:`restore_tail_state`).
"""

from k3_tail.checkpoint.naming import Checkpoint, open_checkpoint
from k3_tail.checkpoint.tail_state import restore_tail_state
from k3_tail.checkpoint.tail_weights import load_tail_weights

__all__ = ["Checkpoint", "load_tail_weights", "open_checkpoint", "restore_tail_state"]
