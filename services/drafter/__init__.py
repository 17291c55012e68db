"""The drafter role: the proposers (one per drafting method), the DFlash-2 model, and its gRPC service."""
