"""Examples that use k3_tail inside a model: ``examples.kimi_k3_moe_layer`` (a Kimi-K3 latent MoE layer in
tensor parallelism) and ``examples.kimi_k3_moe_reference`` (its float64 numpy reference)."""
