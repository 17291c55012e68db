"""The blocks of a paged KV cache: which are free, who holds each, and the prefix cache over full ones.

A block is free (no holder, no hash), held (a reference count of requests whose tables name it) or cached (no holder,
its hash kept: a later request with the same prefix takes it back). Cached blocks are evicted least recently used
first when a request needs a block and none is free. A full block's K/V never change once written (a request writes
past its full blocks only), so a block shared by several requests is never copied."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left: the caller preempts a request or waits."""


@dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hits: int = 0  # of them, found cached (prefix_cache_hits)
    evictions: int = 0  # cached blocks reused for other tokens


class BlockPool:
    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> its prefix hash
        self._by_hash: dict[int, int] = {}  # prefix hash -> block
        self._cached: OrderedDict[int, None] = OrderedDict()  # unheld blocks with a hash, least recently used first
        self.stats = PrefixStats()

    @property
    def free(self) -> int:
        """Blocks a request can take now: the free ones and the cached ones it may evict."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Blocks some request holds."""
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        return len(self._cached)

    def holders(self, block: int) -> int:
        return self._refs[block]

    def take(self) -> int:
        """A block for new tokens, held once: a free one, else the least recently used cached one (its hash
        forgotten)."""
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            self.stats.evictions += 1
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are held")
        self._refs[block] = 1
        return block

    def drop(self, block: int) -> None:
        """One holder fewer; with none left the block is cached (it has a hash) or free."""
        if self._refs[block] <= 0:
            raise RuntimeError(f"block {block} dropped more often than held")
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if block in self._hash_of:
            self._cached[block] = None
        else:
            self._free.append(block)

    def match(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached chain of `hashes` (a prompt's leading blocks), each now held once more."""
        found = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        for block in found:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
        return found

    def publish(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Full blocks of committed tokens, by their prefix hashes: later requests may match them. A hash already
        known keeps its block (the other holds the same K/V)."""
        if not self.caching:
            return
        for block, h in zip(blocks, hashes):
            if block in self._hash_of or h in self._by_hash:
                continue
            self._hash_of[block] = h
            self._by_hash[h] = block

