"""Prefix-aware routing over a version's replicas: a new request goes where its prompt's leading KV blocks were sent
before (their prefill skipped there), unless that replica is much busier than the least loaded one."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from blockspec.common.config import RoutingConfig
from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS, block_hashes

DEFAULT_CAPACITY_BLOCKS = 65536  # blocks remembered per replica where its KV cache's size is not known


class Loaded(Protocol):
    """A replica as routing sees it: hashable (by identity) and with its requests held (queued and running)."""

    @property
    def load(self) -> int: ...


R = TypeVar("R", bound=Loaded)


class BlockMemory:
    """The block hashes recently sent to one replica, at most `capacity`, the least recently sent forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` held here: a cache serves a prefix only, so the walk stops at the first miss."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def record(self, hashes: Sequence[int]) -> None:
        # Deepest block first, so that a prompt's leading blocks are the most recent and eviction cuts chains from
        # their tail (a chain without its head matches nothing).
        for h in reversed(hashes):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class PrefixRouter(Generic[R]):
    """Cache-aware replica choice, as SGLang's router makes it.

    A replica is overloaded when its load exceeds the least loaded replica's by more than `balance_abs_threshold`
    requests and by more than `balance_rel_threshold` times. Among the others, the one holding the longest chain of
    the prompt's leading blocks takes the request, when that chain covers at least `cache_threshold` of the prompt's
    full blocks; else the least loaded does. The chosen replica remembers the prompt's blocks. A replica missing from
    the `replicas` of a call (removed, draining or lost) is forgotten: its cache is gone or going."""

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 4, balance_rel_threshold: float = 1.5,
                 block_size: int = BLOCK_TOKENS) -> None:
        self.capacity_blocks = capacity_blocks
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.block_size = block_size
        self.memory: dict[R, BlockMemory] = {}

    def hashes(self, token_ids: Sequence[int], tenant: str) -> list[int]:
        """The prompt's full blocks as the verifier's prefix cache keys them (salted with the tenant)."""
        return block_hashes(token_ids, self.block_size, tenant)

    def route(self, replicas: Sequence[R], token_ids: Sequence[int], tenant: str) -> R:
        """The replica for a prompt of `tenant` (choose, over its block hashes); a lone replica takes it unhashed."""
        if len(replicas) == 1:
            self._forget_all_but(replicas)
            return replicas[0]
        return self.choose(replicas, self.hashes(token_ids, tenant))

    def choose(self, replicas: Sequence[R], hashes: Sequence[int]) -> R:
        """The replica for a prompt whose full blocks hash to `hashes`; it remembers them."""
        self._forget_all_but(replicas)
        least = min(r.load for r in replicas)
        open_ = [r for r in replicas if not self.overloaded(r.load, least)]
        matched = {r: self._matched(r, hashes) for r in open_}
        best = max(open_, key=lambda r: (matched[r], -r.load))
        if matched[best] < self.cache_threshold * len(hashes):
            best = min(open_, key=lambda r: (r.load, -matched[r]))
        if hashes:
            self.memory.setdefault(best, BlockMemory(self.capacity_blocks)).record(hashes)
        return best

    def overloaded(self, load: int, least: int) -> bool:
        """Whether a replica holding `load` requests is too far above the least loaded (`least`) to take one more
        for its cache."""
        return load - least > self.balance_abs_threshold and load > least * self.balance_rel_threshold

    def _matched(self, replica: R, hashes: Sequence[int]) -> int:
        memory = self.memory.get(replica)
        return memory.matched(hashes) if memory is not None else 0

    def _forget_all_but(self, replicas: Sequence[R]) -> None:
        kept = set(replicas)
        for gone in [r for r in self.memory if r not in kept]:
            del self.memory[gone]


def prefix_router(cfg: RoutingConfig, block_size: int = BLOCK_TOKENS,
                  capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> PrefixRouter | None:
    """The router server.routing asks for, over the replicas' KV caches of `capacity_blocks` blocks of `block_size`
    positions; None: the least loaded replica takes each request."""
    if cfg.policy == "least_loaded":
        return None
    return PrefixRouter(capacity_blocks, block_size=block_size, cache_threshold=cfg.cache_threshold,
                        balance_abs_threshold=cfg.balance_abs_threshold, balance_rel_threshold=cfg.balance_rel_threshold)
