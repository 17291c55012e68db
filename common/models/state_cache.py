"""The per-slot state of a hybrid model's linear-attention layers, beside the KV cache of its attention layers.

A Gated DeltaNet layer carries two states per request: the last conv_kernel - 1 inputs of its causal convolution and
its recurrent state (one [k_head_dim, v_head_dim] matrix per value head, kept in fp32). A KV cache rolls back by
setting a length; a recurrent state cannot: it has folded every token in. So each slot keeps two buffers of each
state. A forward reads the current one and writes the other, then they swap; the buffer it read stays as it was, the
state before that forward, together with what the forward's tokens feed into the recurrence (their convolution inputs
and their k, v, decay and beta). Setting the slot's length to a position inside that forward replays the recurrence
from the kept state over the tokens before the position (`replay`): the step that accepts j of k drafts costs j + 1
token updates of each layer's state and no model forward, and a slot holds two states plus one block of those inputs.
The other way, `rollback="states"`, keeps the state after every token of the forward and copies the one wanted: no
replay, T states a slot. Positions before the last forward cannot be reached either way (the router never asks).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from blockspec.common.kernels.delta_rule import delta_rule_steps, prefill_blocks
from blockspec.common.models.kv_cache import PagedKVCache
from blockspec.common.models.model_config import ModelConfig

ROLLBACKS = ("replay", "states")


@dataclass
class _Block:
    """What a slot's last forward fed its linear layers, per layer: the convolution's inputs [n, conv_dim] and the
    recurrence's k, v, g, beta (n tokens), or (rollback="states") the state after each token."""

    start: int  # the slot's length before the forward
    n: int  # its tokens
    at: int  # the length the current buffers hold
    conv_in: list[torch.Tensor]
    recurrence: list[tuple[torch.Tensor, ...]]


class SlotStates:
    """Conv and recurrent states of every linear layer for `num_slots` requests, two buffers each (see the module)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", rollback: str = "replay", max_block: int = 64) -> None:
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback {rollback!r}: expected one of {ROLLBACKS}")
        lin, n = cfg.linear, len(cfg.linear_layers)
        self.cfg, self.rollback, self.max_block = cfg, rollback, max_block
        # [layers, slots, 2 buffers, conv_dim, conv_kernel - 1] in the model dtype, as the convolution reads them
        self.conv = torch.zeros(n, num_slots, 2, lin.conv_dim, lin.conv_kernel - 1, dtype=dtype, device=device)
        # [layers, slots, 2 buffers, v_heads, k_head_dim, v_head_dim], fp32 whatever the model dtype
        self.recurrent = torch.zeros(n, num_slots, 2, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim,
                                     dtype=torch.float32, device=device)
        self.current = [0] * num_slots  # which buffer holds the slot's state
        self._blocks: dict[int, _Block] = {}
        # replay(state [1, Hv, dk, dv], k, v, g, beta [1, j, ...]) -> the state after those tokens: the recurrence
        # that wrote the kept tokens (the CUDA runner keeps its own kernel's inputs and sets its own)
        self.replay = lambda state, k, v, g, beta: delta_rule_steps(state, k, v, g, beta)[1]

    @staticmethod
    def nbytes(cfg: ModelConfig, dtype: torch.dtype, rollback: str = "replay", block: int = 16) -> dict[str, int]:
        """Bytes one slot holds: the two buffers of each state, and the speculative extras of a forward of `block`
        tokens (replay: the convolution inputs and k, v, g, beta; states: the state after each token)."""
        lin, n = cfg.linear, len(cfg.linear_layers)
        if lin is None:
            return {"conv": 0, "recurrent": 0, "speculative": 0}
        state = lin.num_v_heads * lin.k_head_dim * lin.v_head_dim * 4
        per_token = (lin.conv_dim * dtype.itemsize + lin.num_v_heads * (lin.k_head_dim + lin.v_head_dim + 2) * 4
                     if rollback == "replay" else state)
        return {"conv": 2 * n * lin.conv_dim * (lin.conv_kernel - 1) * dtype.itemsize, "recurrent": 2 * n * state,
                "speculative": n * block * per_token}

    def reset(self, slot: int) -> None:
        """A new request's state: zeros."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        self.current[slot] = 0
        self._blocks.pop(slot, None)

    def begin(self, slots: list[int], starts: list[int], lengths: list[int], device: torch.device) -> StateStep:
        return StateStep(self, slots, starts, lengths, device)

    def _moved(self, slot: int, length: int) -> _Block | None:
        """The slot's last forward where `length` moves its state within it (None: nothing to do); a length outside it
        is refused."""
        block = self._blocks.get(slot)
        if block is None or length == block.at:
            return None
        if not block.start <= length <= block.start + block.n:
            raise ValueError(f"slot {slot}: the linear-attention state holds positions {block.start}.."
                             f"{block.start + block.n} of its last forward, not {length}")
        return block

    def set_length(self, slot: int, length: int) -> None:
        """Make the slot's state the state after its first `length` tokens (within its last forward)."""
        block = self._moved(slot, length)
        if block is None:
            return
        j, cur = length - block.start, self.current[slot]
        prev, k1 = 1 - cur, self.cfg.linear.conv_kernel - 1
        for layer, (conv_in, rec) in enumerate(zip(block.conv_in, block.recurrence)):
            inputs = torch.cat((self.conv[layer, slot, prev], conv_in[:j].transpose(0, 1)), dim=1)
            self.conv[layer, slot, cur] = inputs[:, inputs.shape[1] - k1 :]
            if j == 0:
                self.recurrent[layer, slot, cur] = self.recurrent[layer, slot, prev]
            elif self.rollback == "states":
                self.recurrent[layer, slot, cur] = rec[0][j - 1]
            else:
                k, v, g, beta = (t[None, :j] for t in rec)
                self.recurrent[layer, slot, cur] = self.replay(self.recurrent[layer, slot, prev][None], k, v, g,
                                                               beta)[0]
        block.at = length

    def keep(self, slot: int, start: int, n: int, conv_in: list[torch.Tensor],
             recurrence: list[tuple[torch.Tensor, ...]]) -> None:
        """A forward of n tokens at `start` wrote the slot's other buffers: swap, and keep what a rollback within it
        replays (per layer its conv inputs [n, conv_dim] and recurrence inputs [n, ...]; nothing past max_block)."""
        self.current[slot] = 1 - self.current[slot]
        if n > self.max_block or not conv_in:  # a prefill chunk: nothing kept (no step rolls one back)
            self._blocks[slot] = _Block(start + n, 0, start + n, [], [])
        else:
            self._blocks[slot] = _Block(start, n, start + n, conv_in, recurrence)


class StepStates(SlotStates):
    """The slot states of the CUDA runner's captured steps (`cuda_steps.HybridStaticStep`). A step stores, with each
    slot, what a rollback within it replays (`kept`: the convolution's inputs and outputs [layers, slots, width, 2,
    conv_dim]; `kept_gates`: g and beta [layers, slots, width, 2, v_heads], fp32) for forwards of up to `width` tokens.
    A rollback (`set_length`) is recorded, and `flush` - called before the next forward - runs every recorded one, all
    layers of all slots, in one `gpu_kernels.rollback_states` launch."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str,
                 width: int) -> None:
        super().__init__(cfg, num_slots, dtype, device, "replay", max_block=width)
        lin, n = cfg.linear, len(cfg.linear_layers)
        self.kept = torch.zeros(n, num_slots, width, 2, lin.conv_dim, dtype=dtype, device=device)
        self.kept_gates = torch.zeros(n, num_slots, width, 2, lin.num_v_heads, dtype=torch.float32, device=device)
        self._pending: dict[int, int] = {}  # slot -> the kept tokens its rollback replays

    @staticmethod
    def kept_bytes(cfg: ModelConfig, dtype: torch.dtype, width: int) -> int:
        """What one slot's kept tokens take."""
        lin = cfg.linear
        return len(cfg.linear_layers) * width * 2 * (lin.conv_dim * dtype.itemsize + lin.num_v_heads * 4)

    def reset(self, slot: int) -> None:
        super().reset(slot)
        self._pending.pop(slot, None)

    def keep(self, slot: int, start: int, n: int, width: int) -> None:
        """A forward of n tokens at `start`, `width` wide (its longest row), wrote the slot's other buffers and, where
        the width is within the kept width, its kept tokens."""
        self.current[slot] = 1 - self.current[slot]
        self._pending.pop(slot, None)
        within = width <= self.max_block
        self._blocks[slot] = _Block(start if within else start + n, n if within else 0, start + n, [], [])

    def set_length(self, slot: int, length: int) -> None:
        block = self._moved(slot, length)
        if block is None:
            return
        if length == block.start + block.n and slot in self._pending:
            del self._pending[slot]  # not rolled back yet: the buffers hold what the forward wrote
        else:  # (after a flush the buffers hold the state rolled back: the forward's tokens are replayed)
            self._pending[slot] = length - block.start
        block.at = length

    def flush(self) -> None:
        """Run the recorded rollbacks: each slot's current buffers become the state after its kept tokens."""
        if not self._pending:
            return
        from blockspec.common.kernels import gpu_kernels as gk

        slots = list(self._pending)
        index = torch.tensor([slots, [self.current[s] for s in slots], list(self._pending.values())],
                             dtype=torch.long).to(self.conv.device, non_blocking=True)
        gk.rollback_states(self.recurrent, self.conv, self.kept, self.kept_gates, index[0], index[1], index[2],
                           self.cfg.linear.num_k_heads)
        self._pending.clear()


class StateStep:
    """One forward's access to the states: each layer reads the rows' current buffers and writes the others;
    `finish` swaps them and keeps the block for a rollback."""

    def __init__(self, states: SlotStates, slots: list[int], starts: list[int], lengths: list[int],
                 device: torch.device) -> None:
        self.states, self.slots, self.starts, self.lengths = states, slots, starts, lengths
        self.slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        read = [states.current[s] for s in slots]
        self.read = torch.tensor(read, dtype=torch.long, device=device)
        self.write = 1 - self.read
        # per row, its leading tokens that are a prompt's whole blocks: the chunked delta rule runs them, and the
        # forward keeps nothing for a rollback (`delta_rule.prefill_blocks`)
        self.chunked = prefill_blocks(starts, lengths)
        self.keep = states.rollback == "states" and max(lengths) <= states.max_block and not any(self.chunked)
        self._conv_in: list[torch.Tensor] = []
        self._recurrence: list[tuple[torch.Tensor, ...]] = []

    def conv_state(self, layer: int) -> torch.Tensor:  # [B, conv_dim, conv_kernel - 1]
        return self.states.conv[layer, self.slot_index, self.read]

    def recurrent_state(self, layer: int) -> torch.Tensor:  # [B, Hv, dk, dv]
        return self.states.recurrent[layer, self.slot_index, self.read]

    def store(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor, conv_in: torch.Tensor,
              recurrence: tuple[torch.Tensor, ...]) -> None:
        """The layer's new states [B, ...] and what a rollback replays: conv_in [B, T, conv_dim], recurrence
        (k, v, g, beta [B, T, ...], or the kept states [B, T, Hv, dk, dv])."""
        self.states.conv[layer, self.slot_index, self.write] = conv
        self.states.recurrent[layer, self.slot_index, self.write] = recurrent
        self._conv_in.append(conv_in)
        self._recurrence.append(recurrence)

    def finish(self) -> None:
        kept = not any(self.chunked)
        for b, (slot, start, n) in enumerate(zip(self.slots, self.starts, self.lengths)):
            self.states.keep(slot, start, n, [c[b, :n] for c in self._conv_in] if kept else [],
                             [tuple(t[b, :n] for t in rec) for rec in self._recurrence] if kept else [])


class HybridStates:
    """A hybrid model's linear layers' states beside its attention layers' KV cache (a mixin of a paged cache): a
    slot's length moves both (allocate zeroes the states, a shorter length rolls them back within the last forward)."""

    states: SlotStates | StepStates

    def allocate(self) -> int:
        slot = super().allocate()
        self.states.reset(slot)
        return slot

    def set_length(self, slot: int, length: int) -> None:
        """Length 0 is no token at all: zero states (a tensor-parallel follower starts a slot's new request so)."""
        super().set_length(slot, length)
        if length == 0:
            self.states.reset(slot)
        else:
            self.states.set_length(slot, length)


class StateSnapshots:
    """A hybrid's linear-layer states at the ends of cached prefixes: `capacity` snapshots of a slot's conv and
    recurrent states, each named by the prefix hash of the block it ends (`prefix_hash`), the least recently used
    replaced first. A cached prefix of a hybrid is usable up to its last block with a snapshot."""

    def __init__(self, states: SlotStates, capacity: int) -> None:
        self.states = states
        self.conv = states.conv.new_zeros((capacity, *states.conv[:, 0, 0].shape))  # [n, layers, conv_dim, k - 1]
        self.recurrent = states.recurrent.new_zeros((capacity, *states.recurrent[:, 0, 0].shape))
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # prefix hash -> snapshot, least recently used first
        self._free = list(range(capacity - 1, -1, -1))

    def __contains__(self, prefix_hash: int) -> bool:
        return prefix_hash in self._by_hash

    def save(self, slot: int, prefix_hash: int) -> None:
        """The slot's current states, as those after the prefix `prefix_hash` ends."""
        if prefix_hash in self._by_hash or not (self._free or self._by_hash):
            return
        index = self._free.pop() if self._free else self._by_hash.popitem(last=False)[1]
        cur = self.states.current[slot]
        self.conv[index] = self.states.conv[:, slot, cur]
        self.recurrent[index] = self.states.recurrent[:, slot, cur]
        self._by_hash[prefix_hash] = index

    def load(self, slot: int, prefix_hash: int) -> None:
        """The snapshot into the slot's current states (a slot just reset)."""
        index = self._by_hash[prefix_hash]
        self._by_hash.move_to_end(prefix_hash)
        cur = self.states.current[slot]
        self.states.conv[:, slot, cur] = self.conv[index]
        self.states.recurrent[:, slot, cur] = self.recurrent[index]


class HybridPagedKVCache(HybridStates, PagedKVCache):
    """A paged cache for the attention layers, and the linear layers' states per slot (a fixed cost per request).
    With prefix caching, a cached prefix is taken up to its last block whose states were saved (`snapshot_every`
    positions apart at most, the verifier saves them as a prefill passes there: `StateSnapshots`)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 prefix_caching: bool = False, snapshots: int | None = None, spare_slots: int = 0,
                 spare_blocks: int = 0, step_width: int | None = None) -> None:
        """snapshots: the states kept for cached prefixes (unset: 4 a slot); step_width: the states are the CUDA
        runner's (`StepStates`), kept for forwards of up to that many tokens; spare_slots: state rows after the
        requests' (a captured step's padding rows read and write there), spare_blocks: KV blocks after the pool's (its
        padding rows' K/V)."""
        super().__init__(len(cfg.attention_layers), num_slots, cfg.num_kv_heads, max_len, cfg.head_dim, num_blocks,
                         block_size, dtype, device, prefix_caching=prefix_caching, spare_blocks=spare_blocks)
        rows = num_slots + spare_slots
        self.states = (SlotStates(cfg, rows, dtype, device, "replay") if step_width is None else
                       StepStates(cfg, rows, dtype, device, step_width))
        self.snapshots = StateSnapshots(self.states, 4 * num_slots if snapshots is None else snapshots)

    def attach(self, slot: int, hashes: list[int]) -> int:
        """As PagedKVCache.attach, up to the last matched block whose states were saved; those states restored."""
        matched = super().attach(slot, hashes) // self.block_size
        usable = matched
        while usable and hashes[usable - 1] not in self.snapshots:
            usable -= 1
        for block in self.held[slot][usable:]:
            self.pool.drop(block)
        del self.held[slot][usable:]
        self.lengths[slot] = usable * self.block_size
        if usable:
            self.snapshots.load(slot, hashes[usable - 1])
        return self.lengths[slot]
