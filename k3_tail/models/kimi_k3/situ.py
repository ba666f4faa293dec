"""Kimi-K3's SiTU gated activation, which its routed and its shared experts both apply."""

import jax
import jax.numpy as jnp

SITU_GATE_BOUND, SITU_UP_BOUND = 4.0, 25.0


def situ(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Per element: 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25), its factors bounded by 4 and 25."""
    bounded_gate = SITU_GATE_BOUND * jnp.tanh(gate / SITU_GATE_BOUND) * jax.nn.sigmoid(gate)
    return bounded_gate * (SITU_UP_BOUND * jnp.tanh(up / SITU_UP_BOUND))
