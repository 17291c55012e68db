"""Model definitions: config.json read as transformers reads it, checkpoint loading, the decoders (dense, hybrid,
MoE) under their published weight names, and the caches their forward writes (KV cache, linear-layer states)."""
