"""KV caches: a request's row is its slot; a rollback sets the slot's length.

`PagedKVCache` (the verifier's, both runners) keeps blocks of block_size positions, taken as a request grows and given
back as it ends, named by a table per slot, with a prefix cache over full blocks (block_pool.py): a layer's K/V lie in
[blocks, kv_heads, block_size, hd], and position p of a slot in block table[p >> block_shift] at p & (block_size - 1).
`SlotKVCache` keeps one fixed buffer of max_len positions per slot (the DFlash drafter's context)."""

from __future__ import annotations

import torch

from blockspec.common.models.block_pool import BlockPool, OutOfBlocks

# Keys a CUDA forward reads come in multiples of this (the rest masked). The attention kernel torch picks
# first on an H200, cuDNN's, builds an execution plan for each new shape, and a decode's key length grows
# by one every step: with spans there are at most max_len / CUDA_KEY_SPAN shapes to plan.
CUDA_KEY_SPAN = 256


class SlotKVCache:
    """K/V for `num_slots` requests of up to `max_len` tokens each.

    A slot's length is the number of tokens whose K/V are valid. A forward writes new tokens at
    positions [length, length + n) and the caller then sets the length (advance, or roll back a
    rejected draft: the stale entries are simply overwritten by the next forward).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        spare_slots: int = 0,
    ) -> None:
        # spare_slots: rows past the last slot that no request gets; a captured step writes its padding rows there
        shape = (num_layers, num_slots + spare_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, max_len, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.key_step = CUDA_KEY_SPAN if torch.device(device).type == "cuda" else 1  # see key_span
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def nbytes(num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
               dtype: torch.dtype = torch.float32) -> int:
        """What a cache of these dimensions allocates (K and V), before it is built."""
        return 2 * num_layers * num_slots * num_kv_heads * max_len * head_dim * dtype.itemsize

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV cache slot")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"slot {slot} released twice")
        self.lengths[slot] = 0
        self._free.append(slot)

    def set_length(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.max_len:
            raise ValueError(f"slot length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [kv_heads, n, hd] of one slot at positions [start, start + n)."""
        self.k[layer, slot, :, start : start + k.shape[1]] = k
        self.v[layer, slot, :, start : start + v.shape[1]] = v

    def key_span(self, longest: int) -> int:
        """Keys a forward over rows of up to `longest` valid keys reads: rounded up to key_step, within
        max_len (the keys past a row's own length are masked)."""
        return min(self.max_len, -(-longest // self.key_step) * self.key_step)

    def read(self, layer: int, slots: torch.Tensor, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [len(slots), kv_heads, key_len, hd]."""
        return self.k[layer, slots, :, :key_len], self.v[layer, slots, :, :key_len]



class PagedKVCache(SlotKVCache):
    """K/V in blocks of `block_size` positions (a power of two), `num_blocks` of them shared by `num_slots` request
    rows. A slot takes blocks as it grows (`reserve`, before a forward writes), gives them back on release, and may
    start from a cached prefix's blocks (`attach`). Rolling back keeps the blocks (the next forward writes there)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", prefix_caching: bool = True, spare_blocks: int = 0) -> None:
        """spare_blocks: blocks after the pool's num_blocks that no request gets (`spare_block` the first); the CUDA
        runner's captured steps write their padding rows there."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size {block_size}: a power of two")
        shape = (num_layers, num_blocks + spare_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, blocks, kv_heads, block_size, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.key_step = block_size
        self.block_size = block_size
        self.block_shift = block_size.bit_length() - 1
        self.max_blocks = -(-max_len // block_size)
        self.pool = BlockPool(num_blocks, prefix_caching)
        self.spare_block = num_blocks
        # A slot's blocks, and the same as a table row [slots, max_blocks] (0 past its blocks: never read, masked)
        self.held: list[list[int]] = [[] for _ in range(num_slots)]
        self.table = torch.zeros(num_slots, self.max_blocks, dtype=torch.long)
        self._rows: list[torch.Tensor] | None = None  # `tables`' one-row views
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        return SlotKVCache.nbytes(num_layers, 1, num_kv_heads, block_size, head_dim, dtype)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def release(self, slot: int) -> None:
        super().release(slot)
        for block in self.held[slot]:
            self.pool.drop(block)
        self.held[slot] = []

    def reserve(self, slot: int, end: int) -> None:
        """Blocks for positions [0, end) of the slot: OutOfBlocks where the pool has too few (none is taken then)."""
        if end > self.max_len:
            raise ValueError(f"slot {slot}: position {end - 1} does not fit max_len {self.max_len}")
        held = self.held[slot]
        more = self.blocks_for(end) - len(held)
        if more <= 0:
            return
        if more > self.pool.free:
            raise OutOfBlocks(f"slot {slot} needs {more} more KV blocks, {self.pool.free} are free")
        for _ in range(more):
            block = self.pool.take()
            self.table[slot, len(held)] = block
            held.append(block)

    def follow(self, slot: int, keep: int, blocks: list[int]) -> None:
        """A tensor-parallel follower's slot holds what its lead's does: its first `keep` blocks, then `blocks` (the
        lead's, taken from the lead's pool: this cache's pool is not used)."""
        held = self.held[slot][:keep] + list(blocks)
        self.held[slot] = held
        if blocks:
            self.table[slot, keep : len(held)] = torch.tensor(blocks, dtype=torch.long)

    def attach(self, slot: int, hashes: list[int]) -> int:
        """Start an empty slot from the longest cached chain of these prefix hashes: its blocks, shared; returns the
        positions they hold (the slot's length now)."""
        assert not self.held[slot] and self.lengths[slot] == 0, "attach to an empty slot"
        blocks = self.pool.match(hashes)
        self.held[slot] = blocks
        self.table[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        self.lengths[slot] = len(blocks) * self.block_size
        return self.lengths[slot]

    def publish(self, slot: int, hashes: list[int]) -> None:
        """The slot's first len(hashes) blocks hold those prefixes' K/V (all their positions written): cache them."""
        n = min(len(hashes), len(self.held[slot]), self.lengths[slot] // self.block_size)
        self.pool.publish(self.held[slot][:n], hashes[:n])

    def tables(self, host_slots: list[int], key_len: int) -> torch.Tensor:
        """One row: its whole table row (a view made once: the readers stop at their own keys); rows: their tables
        over [0, key_len) copied out."""
        if len(host_slots) == 1:
            if self._rows is None or self._rows[0].untyped_storage().data_ptr() != self.table.untyped_storage().data_ptr():
                self._rows = [self.table[s : s + 1] for s in range(self.table.shape[0])]  # (again after a move)
            return self._rows[host_slots[0]]
        return self.table[host_slots, : max(1, self.blocks_for(key_len))]

    def blocks_of(self, tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where tokens lie, each at a position [N] of a row [N] of these tables [B, nb]: (block, offset), [N] each."""
        return tables[rows, positions >> self.block_shift], positions & (self.block_size - 1)

    def gather(self, layer: int, tables: torch.Tensor, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv_heads, key_len, hd] of the rows with these tables, copied out of their blocks."""
        tables = tables[:, : max(1, self.blocks_for(key_len))]
        B, nb = tables.shape
        out = []
        for cache in (self.k[layer], self.v[layer]):
            blocks = cache[tables.reshape(-1)]  # [B * nb, kv_heads, block_size, hd]
            kv, bs, hd = blocks.shape[1:]
            out.append(blocks.view(B, nb, kv, bs, hd).transpose(1, 2).reshape(B, kv, nb * bs, hd)[:, :, :key_len])
        return out[0], out[1]


class BlockRows:
    """One slot's rows of a buffer laid out in a paged cache's blocks ([blocks, block_size, ...], the tap features):
    `rows[start:end]` gathers positions start .. end - 1 through the slot's table row (a view of the table, so it
    follows the slot's blocks as they are taken)."""

    def __init__(self, buffer: torch.Tensor, table_row: torch.Tensor) -> None:
        self.buffer, self.table = buffer, table_row
        self.block_size = buffer.shape[1]
        self.shift = self.block_size.bit_length() - 1

    def __len__(self) -> int:
        return self.table.shape[0] * self.block_size

    def __getitem__(self, index: slice | int) -> torch.Tensor:
        if isinstance(index, int):
            return self[index : index + 1][0]
        start, stop, step = index.indices(len(self))
        if step == 1 and stop - start <= 2 * self.block_size:  # a step's few rows: a slice of a block or two
            pieces, p, mask = [], start, self.block_size - 1
            while p < stop:
                run = min(stop - p, self.block_size - (p & mask))
                pieces.append(self.buffer[int(self.table[p >> self.shift]), p & mask : (p & mask) + run])
                p += run
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        positions = torch.arange(start, stop, step)
        blocks = self.table[positions >> self.shift].to(self.buffer.device)
        return self.buffer[blocks, (positions & (self.block_size - 1)).to(self.buffer.device)]


def slot_rows(buffer: torch.Tensor, table: torch.Tensor) -> list[BlockRows]:
    """Each slot's rows of a buffer laid out in a paged cache's blocks, through its tables [slots, max_blocks]."""
    return [BlockRows(buffer, row) for row in table.unbind(0)]


__all__ = ["BlockRows", "OutOfBlocks", "PagedKVCache", "SlotKVCache", "slot_rows"]
