"""The greedy block proposal as a CUDA graph per (batch bucket, block length): static inputs (each request's anchor,
slot and context length), attention over the drafter's whole static context cache with the visibility computed on the
device, the path-selector walk on the device, and one device-to-host copy of the drafted tokens. Padding requests use
a spare slot of the drafter's cache. On the CPU the same step runs uncaptured (the tests)."""

from __future__ import annotations

import torch

from blockspec.common.cuda_runner import Graphs, batch_sizes, bucket
from blockspec.services.drafter.dflash.model import DrafterContext


class CapturedBlocks:
    """Runs `DFlashProposer`'s greedy block step over static buffers; see the module docstring. The proposer's cache
    must have a spare slot (num_slots of them for requests, then the spare)."""

    def __init__(self, proposer, num_slots: int, capture: bool) -> None:
        self.p, self.spare = proposer, num_slots
        self.batch_sizes = batch_sizes(num_slots)
        self.graphs = Graphs(proposer.device, capture)
        self._inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pin = proposer.device.type == "cuda"  # host copies in pinned memory: the copies run asynchronously

    def warm_up(self, blocks: list[int]) -> None:
        """Capture the proposal of every batch bucket at each block length now (padding requests: the spare slot)."""
        for block in blocks:
            for size in self.batch_sizes:
                self.propose([0] * size, [self.spare] * size, [0] * size, block)

    def fits(self, requests: int) -> bool:
        return bucket(requests, self.batch_sizes) is not None

    def propose(self, anchors: list[int], slots: list[int], ctx_lens: list[int], block: int) -> list[list[int]]:
        """Each request's block_size - 1 (or block - 1) greedy draft tokens."""
        key = (bucket(len(anchors), self.batch_sizes), block)
        if key not in self._inputs:
            host = torch.zeros((3, key[0]), dtype=torch.long, pin_memory=self._pin)
            self._inputs[key] = (host, torch.zeros((3, key[0]), dtype=torch.long, device=self.p.device))
        host, inputs = self._inputs[key]
        pad = key[0] - len(anchors)
        host.copy_(torch.tensor([anchors + [0] * pad, slots + [self.spare] * pad, ctx_lens + [0] * pad]))
        inputs.copy_(host, non_blocking=True)
        tokens = self.graphs.run(key, self.step, (inputs, block))
        return tokens.cpu().tolist()[: len(anchors)]  # the proposal's one wait

    def step(self, inputs: torch.Tensor, block: int) -> torch.Tensor:
        """inputs [3, R] (anchors, slots, context lengths) -> tokens [R, block - 1]."""
        p = self.p
        anchors, slots, lens = inputs.unbind(0)
        dev, R = inputs.device, inputs.shape[1]
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
