"""The verifier role: the target, its KV cache and tap features, the acceptance rules, and its gRPC service."""
