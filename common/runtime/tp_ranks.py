"""The ranks of a target split with tensor parallelism (common/runtime/tensor_parallel.py): rank 0 leads in the verifier's
process (`LeadRunner`), the others are its child processes (`start_followers`, `python -m blockspec.common.runtime.tp_ranks`)
that run each step the lead sends (`follow`) and end with it."""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from blockspec.common.runtime.cuda_runner import CudaRunner
from blockspec.common.runtime.runner import ForwardResult, Runner, Segment, segment_starts
from blockspec.common.runtime.tensor_parallel import exit_on_lost_rank, free_port, init, rank_device

log = logging.getLogger(__name__)


class Leads:
    """Rank 0's runner: before each forward it sends the step - each segment, its slot's length and the slot's KV
    blocks the others have not been sent yet - to the other ranks, which run the same forward on their shards
    (`follow`) with the same block tables."""

    def forward(self, segments: Sequence[Segment], tap_dest: torch.Tensor | None = None) -> ForwardResult:
        starts = segment_starts(self.cache, self.max_len, segments)  # refused before the others see it
        try:
            dist.broadcast_object_list([[(s.slot, tuple(s.token_ids), s.last_only, start, *self._blocks_news(s.slot))
                                         for s, start in zip(segments, starts)]], src=0)
            return super().forward(segments, tap_dest)
        except Exception as e:  # a rank gone, or one failed: the ranks are out of step for good
            exit_on_lost_rank(e)
            raise

    def _blocks_news(self, slot: int) -> tuple[int, tuple[int, ...]]:
        """What the other ranks lack of the slot's blocks: (how many of those last sent still hold, the blocks after
        them). A slot released and taken again, or started from cached blocks, differs from an early block on."""
        sent = getattr(self, "_sent", None)
        if sent is None:
            sent = self._sent = {}
        held, before = self.cache.held[slot], sent.get(slot, [])
        keep = common_prefix(held, before)
        if keep < len(held) or keep < len(before):
            sent[slot] = list(held)
        return keep, tuple(held[keep:])


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest list both start with."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class LeadRunner(Leads, Runner):
    """Rank 0 of the eager runner."""


class CudaLeadRunner(Leads, CudaRunner):
    """Rank 0 of the CUDA runner: each rank replays its captured steps, the sums over the ranks inside them."""


def follow(runner: Runner | CudaRunner) -> None:
    """A rank other than 0: run each step the lead sends; a lead that is gone (its process ended: the next collective
    fails, or the parent watch sees it) ends this process."""
    while True:
        step = [None]
        try:
            dist.broadcast_object_list(step, src=0)
            if step[0] is None:
                return
            segments = []
            for slot, tokens, last_only, start, keep, blocks in step[0]:
                runner.cache.follow(slot, keep, blocks)  # the lead's blocks: the same tables on every rank
                runner.cache.set_length(slot, start)
                segments.append(Segment(slot, tokens, last_only))
            runner.forward(segments)
        except Exception as e:  # noqa: BLE001 - the lead gone, or this rank failed: the ranks are out of step
            exit_on_lost_rank(e)


def run_follower(rank: int, world: int, address: str, target: str, num_slots: int, max_len: int,
                 query_width: int | None, dtype: str, device: str, threads: int, lead: int, graphs: bool,
                 num_blocks: int | None, block_size: int) -> None:
    """A follower process's whole life: load, join, follow; it ends with its lead (pid `lead`) however that ends."""
    from blockspec.common.models.checkpoint import load_checkpoint

    def watch() -> None:
        while os.getppid() == lead:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="lead-watch", daemon=True).start()
    torch.set_num_threads(threads)
    dev = rank_device(device, rank)  # the lead's device, as it named it: this rank's GPU follows its index
    init(rank, world, address, dev)
    checkpoint = load_checkpoint(target)
    if graphs:
        runner = CudaRunner(checkpoint, num_slots, max_len, (), getattr(torch, dtype), dev, tp=(rank, world),
                            num_blocks=num_blocks, block_size=block_size)
    else:
        runner = Runner(checkpoint, num_slots, max_len, query_width, (), getattr(torch, dtype), dev, tp=(rank, world),
                        block_size=block_size, num_blocks=num_blocks)
    follow(runner)
    dist.destroy_process_group()


_followers: list[subprocess.Popen] = []


def start_followers(world: int, target: str, num_slots: int, max_len: int, query_width: int | None,
                    dtype: torch.dtype, device: torch.device, graphs: bool = False, num_blocks: int | None = None,
                    block_size: int = 16) -> str:
    """Ranks 1..world-1 as child processes of this one (`python -m blockspec.common.runtime.tp_ranks`; each ends with
    this process), each with the lead's runner (graphs: the CUDA runner's) and KV cache blocks; the process group's
    address, for this process to join as rank 0."""
    address = f"127.0.0.1:{free_port()}"
    threads = max(1, torch.get_num_threads() // world)
    for rank in range(1, world):
        args = [rank, world, address, target, num_slots, max_len, query_width, str(dtype).split(".")[-1],
                str(device), threads, os.getpid(), graphs, num_blocks, block_size]
        _followers.append(subprocess.Popen([sys.executable, "-m", "blockspec.common.runtime.tp_ranks", json.dumps(args)]))
    if len(_followers) == world - 1:
        atexit.register(_stop_followers)
    return address


def _stop_followers() -> None:
    for proc in _followers:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run_follower(*json.loads(sys.argv[1]))
