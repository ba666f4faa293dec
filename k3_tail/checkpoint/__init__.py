"""The tail's weights from a Hugging Face checkpoint, each device reading only its own block
(:func:`load_tail_weights`), and a tail's saved ``nnx.state`` restored at another TP size
(:func:`restore_tail_state`)."""

from k3_tail.checkpoint.naming import Checkpoint, open_checkpoint
from k3_tail.checkpoint.tail_state import restore_tail_state
from k3_tail.checkpoint.tail_weights import load_tail_weights

__all__ = ["Checkpoint", "load_tail_weights", "open_checkpoint", "restore_tail_state"]
