"""Generation from the actor's weights behind one engine interface (KV cache, sampling, stop rules)."""
