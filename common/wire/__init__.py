"""The wire between processes: gRPC servers and the roles' stream loop, shared tensors, API and role keys, TLS."""
