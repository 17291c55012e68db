"""Kernels: the CPU fast path (C++ built on first use), the batch-invariant Triton operators and their torch
references, the gated delta rule in torch. Imports errors and argtypes only."""
