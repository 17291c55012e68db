"""The runner backends behind one interface (`forward(segments, tap_dest)` -> `runner.ForwardResult`): `runner.Runner`
for the CPU (its C++ kernels) and for models the CUDA runner does not take, `cuda_runner.CudaRunner` for models on
CUDA (captured steps, batch-invariant numerics)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.runtime.cuda_runner import CudaRunner, unsupported
from blockspec.common.runtime.runner import Runner
from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS

log = logging.getLogger(__name__)

BACKENDS = ("auto", "eager", "graphs")


def uses_cuda_runner(cfg, device: torch.device, backend: str = "auto") -> bool:
    """Whether `make_runner` gives the CUDA runner: backend "graphs", or "auto" on CUDA for a model it takes."""
    return backend == "graphs" or (backend == "auto" and device.type == "cuda" and unsupported(cfg) is None)


def make_runner(checkpoint: Checkpoint, num_slots: int, max_len: int | None = None, query_width: int | None = None,
                tap_layers: Sequence[int] = (), dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                backend: str = "auto", tensor_parallel_size: int = 1, kv_blocks: int | None = None,
                block_size: int = BLOCK_TOKENS, prefix_caching: bool = False) -> Runner | CudaRunner:
    """The backend for the device: `cuda_runner.CudaRunner` (captured steps, batch-invariant numerics) for a model on
    CUDA that it takes, else `Runner` (the CPU's C++ kernels, torch's operations elsewhere). backend "eager" is always
    `Runner`, "graphs" always `CudaRunner` (an error where it does not take the model). tensor_parallel_size > 1: this
    process leads the ranks (common/runtime/tensor_parallel.py), the others start as its children; the eager runner.
    Both runners' KV caches are paged (kv_blocks blocks of block_size positions, unset: num_slots requests of
    max_len); `Runner`'s has a prefix cache where prefix_caching is set (not under tensor parallelism), the CUDA
    runner's none."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if tensor_parallel_size > 1:
        from blockspec.common.runtime import tensor_parallel as tp
        from blockspec.common.runtime import tp_ranks

        why = tp.unsupported(checkpoint.config, tensor_parallel_size)
        if why is not None:
            raise InvalidArgument("tensor_parallel_size", f"{tensor_parallel_size}: {why}")
        dev = tp.rank_device(device, 0)
        max_len = min(max_len or checkpoint.config.max_position_embeddings, checkpoint.config.max_position_embeddings)
        graphs = uses_cuda_runner(checkpoint.config, dev, backend)
        address = tp_ranks.start_followers(tensor_parallel_size, str(checkpoint.path), num_slots, max_len, query_width,
                                           dtype, dev, graphs, kv_blocks, block_size)
        tp.init(0, tensor_parallel_size, address, dev)
        if graphs:
            return tp_ranks.CudaLeadRunner(checkpoint, num_slots, max_len, tap_layers, dtype, dev,
                                           tp=(0, tensor_parallel_size), num_blocks=kv_blocks, block_size=block_size)
        return tp_ranks.LeadRunner(checkpoint, num_slots, max_len, query_width, tap_layers, dtype, dev,
                                   tp=(0, tensor_parallel_size), block_size=block_size, num_blocks=kv_blocks)
    reason = unsupported(checkpoint.config)
    if uses_cuda_runner(checkpoint.config, torch.device(device), backend):
        if query_width:
            log.info("the CUDA runner is batch-invariant at every width: query_width %d is not needed", query_width)
        return CudaRunner(checkpoint, num_slots, max_len, tap_layers, dtype, device, num_blocks=kv_blocks,
                          block_size=block_size)
    if backend == "auto" and torch.device(device).type == "cuda":
        log.info("%s: the eager runner on %s (the CUDA runner does not take %s)", checkpoint.path, device, reason)
    return Runner(checkpoint, num_slots, max_len, query_width, tap_layers, dtype, device, block_size=block_size,
                  num_blocks=kv_blocks, prefix_caching=prefix_caching)
