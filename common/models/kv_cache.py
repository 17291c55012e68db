"""Slot-based static KV cache: one fixed buffer per layer, a slot per request, rollback = set the length."""

from __future__ import annotations

import torch

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
