"""The Pallas Triton backend's deprecation warning, kept out of the programs of k3_tail's users.

jax 0.12 warns at every lowering of a Triton ``pallas_call`` (a ``DeprecationWarning``, jax's deprecation
"jax-pallas-triton"): while the user's own ``jit`` lowers, after k3_tail's code has returned. A user whose
warnings are errors (``python -W error``, pytest's ``-W error`` or ``filterwarnings = error``) would then
fail because selection picked one_kernel. jax has no switch that silences it (its deprecation registry
can only turn it into an error), and a filter installed when k3_tail is imported would sit below the
"error" filter that pytest installs at the start of every test. So k3_tail installs its filter while
the kernel is traced, into the warnings context in which the lowering then runs: one "ignore" entry
for this message and category only, first in the filters.
"""

from __future__ import annotations

import re
import warnings

# How jax's message starts (jax/_src/pallas/triton/pallas_call_registration.py, jax 0.12).
DEPRECATION_MESSAGE = "The Pallas Triton backend is deprecated"


def ignore_triton_deprecation_warning() -> None:
    """From now on, in the current warnings context (the innermost ``warnings.catch_warnings`` block, else
    the process), ignore jax's ``DeprecationWarning`` that the Pallas Triton backend is deprecated: call it
    while a Triton kernel is traced, so that the lowering that follows does not warn. Every other warning,
    other DeprecationWarnings included, is filtered as before. Installing it again moves the one entry to
    the front of ``warnings.filters``; it never adds a second."""
    message = re.escape(DEPRECATION_MESSAGE)
    first = warnings.filters[0] if warnings.filters else None
    # Already first (every call of tail_forward on a GPU asks): leave the filters, and the caches that a change of
    # them clears, alone.
    if first is not None and first[0] == "ignore" and first[2] is DeprecationWarning and first[3] is None and (
            getattr(first[1], "pattern", None) == message):
        return
    warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)
