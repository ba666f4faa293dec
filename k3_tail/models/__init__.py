"""Models built on the tail: :mod:`k3_tail.models.kimi_k3`, the Kimi-K3 latent MoE layer and a decoder stack of it."""
