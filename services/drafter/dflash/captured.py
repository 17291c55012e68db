"""The greedy block proposal as a CUDA graph per (batch bucket, block length): static inputs (each request's anchor,
slot and context length, and the context positions it has not stored yet), attention over the drafter's whole static
context cache with the visibility computed on the device, the path-selector walk on the device, and one
device-to-host copy of the drafted tokens. The step first stores the context K/V of up to EXTEND new positions a
request (the tokens its last verify committed), read from the verifier's tap buffer where each position lies (its
slot's row, or in a paged cache's layout its block through the slot's table, looked up on the host); a longer
extension (a prompt) runs eagerly before it. Padding requests and positions use a spare slot of the drafter's cache.
On the CPU the same step runs uncaptured (the tests)."""

from __future__ import annotations

import torch

from blockspec.common.models.kv_cache import BlockRows
from blockspec.common.runtime.cuda_runner import Graphs, batch_sizes, bucket
from blockspec.services.drafter.dflash.model import DrafterContext

EXTEND = 16  # new context positions a request the step stores itself (a verify commits at most block_size)


class CapturedBlocks:
    """Runs `DFlashProposer`'s greedy block step over static buffers; see the module docstring. The proposer's cache
    must have a spare slot (num_slots of them for requests, then the spare). tap_buffer: the verifier's buffer the
    proposer's `features` views are rows of; without it every extension runs eagerly."""

    def __init__(self, proposer, num_slots: int, capture: bool, tap_buffer: torch.Tensor | None = None) -> None:
        self.p, self.spare = proposer, num_slots
        self.batch_sizes = batch_sizes(num_slots)
        self.graphs = Graphs(proposer.device, capture)
        self.taps = tap_buffer
        self._inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pin = proposer.device.type == "cuda"  # host copies in pinned memory: the copies run asynchronously

    @torch.inference_mode()
    def warm_up(self, blocks: list[int]) -> None:
        """Capture the proposal of every batch bucket at each block length now (padding requests: the spare slot)."""
        for block in blocks:
            for size in self.batch_sizes:
                self.propose([0] * size, [self.spare] * size, [0] * size, block, [])

    def fits(self, requests: int) -> bool:
        return bucket(requests, self.batch_sizes) is not None

    def _tap_rows(self, features, start: int, count: int) -> list[int] | None:
        """Where positions start .. start + EXTEND - 1 of a request's features lie in the tap buffer: the index along
        its first dimension of each (a slot-laid buffer's slot; a block-laid one's block, through the slot's table:
        `kv_cache.BlockRows`; 0 past `count`), or None where the features are not the buffer's rows."""
        taps = self.taps
        if taps is None:
            return None
        if isinstance(features, BlockRows):
            if (features.buffer.untyped_storage().data_ptr() != taps.untyped_storage().data_ptr()
                    or features.buffer.shape != taps.shape):
                return None
            return features.table[torch.arange(start, start + count) >> features.shift].tolist() + [0] * (EXTEND - count)
        if (not isinstance(features, torch.Tensor)
                or features.untyped_storage().data_ptr() != taps.untyped_storage().data_ptr()
                or features.stride() != taps.stride()[1:]):
            return None
        slot, rest = divmod(features.storage_offset() - taps.storage_offset(), taps.stride(0))
        return [slot] * EXTEND if rest == 0 and 0 <= slot < taps.shape[0] else None

    def propose(self, anchors: list[int], slots: list[int], ctx_lens: list[int], block: int,
                pending: list[tuple]) -> list[list[int]]:
        """Each request's block - 1 greedy draft tokens, its context brought up to ctx_len first (pending: the
        proposer's (slot, start, end, features) of each request that lacks some)."""
        key = (bucket(len(anchors), self.batch_sizes), block)
        extend = {}  # drafter slot -> (start, count, where each position lies in the tap buffer)
        for slot, start, end, features in pending:
            rows = self._tap_rows(features, start, end - start) if end - start <= EXTEND else None
            if rows is None:
                extend = None
                break
            extend[slot] = (start, end - start, rows)
        if extend is None:  # a prompt's context (or features outside the buffer): stored eagerly first
            self.p._extend(pending, None)
            extend = {}
        else:
            self.p._advance(pending)  # the step stores them
        rows = 5 + EXTEND
        if key not in self._inputs:
            host = torch.zeros((rows, key[0]), dtype=torch.long, pin_memory=self._pin)
            self._inputs[key] = (host, torch.zeros((rows, key[0]), dtype=torch.long, device=self.p.device))
        host, inputs = self._inputs[key]
        pad = key[0] - len(anchors)
        none = (0, 0, [0] * EXTEND)
        ext = [extend.get(s, none) for s in slots] + [none] * pad
        host.copy_(torch.tensor([anchors + [0] * pad, slots + [self.spare] * pad, ctx_lens + [0] * pad,
                                 [e[0] for e in ext], [e[1] for e in ext], *zip(*(e[2] for e in ext))]))
        inputs.copy_(host, non_blocking=True)
        tokens = self.graphs.run(key, self.step, (inputs, block))
        return tokens.cpu().tolist()[: len(anchors)]  # the proposal's one wait

    def step(self, inputs: torch.Tensor, block: int) -> torch.Tensor:
        """inputs [5 + EXTEND, R] (anchors, slots, context lengths, the new context positions' start and count, then
        where each of them lies along the tap buffer's first dimension) -> tokens [R, block - 1]."""
        p = self.p
        anchors, slots, lens, ext_start, ext_count = inputs[:5].unbind(0)
        dev, R = inputs.device, inputs.shape[1]
        if self.taps is not None:  # the new context positions' K/V, each layer's, into the cache
            j = torch.arange(EXTEND, device=dev)
            positions = (ext_start[:, None] + j).clamp(max=p.cache.max_len - 1)  # [R, EXTEND]
            rows = self.taps[inputs[5:].t(), positions % self.taps.shape[1]]  # [R, EXTEND, n_taps * H]
            cos, sin = p._cos[positions][:, None], p._sin[positions][:, None]  # [R, 1, EXTEND, hd]
            writes = torch.where(j[None, :] < ext_count[:, None], slots[:, None], self.spare)  # padding: the spare
            for layer, (k, v) in enumerate(p.model.context_kv(p.model.context(rows), cos, sin)):  # [R, KV, E, hd]
                p.cache.k[layer][writes, :, positions] = k.transpose(1, 2)
                p.cache.v[layer][writes, :, positions] = v.transpose(1, 2)
        block_ids = torch.cat([anchors[:, None], torch.full((R, block - 1), p.cfg.mask_token_id, device=dev)], dim=1)
        key_len = p.cache.max_len
        layer_kv = [p.cache.read(layer, slots, key_len) for layer in range(p.cfg.num_layers)]
        visible = torch.arange(key_len, device=dev)[None, :] < lens[:, None]  # [R, key_len]
        positions = lens[:, None] + torch.arange(block, device=dev)  # [R, block]
        ctx = DrafterContext(layer_kv, visible, (p._cos[positions][:, None], p._sin[positions][:, None]), p.cfg,
                             positions)
        hidden = p.model(p.model.block_embeds(p.embedding, block_ids), ctx, p.use_dynamic_conv)[:, 1:]  # [R, block-1, H]
        logits = p.model.draft_logits(hidden, p.lm_head)
        return p.greedy_tokens(hidden, logits, anchors)
