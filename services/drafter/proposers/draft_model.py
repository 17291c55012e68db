"""Method `draft_model`: an independent small causal LM, run by the same runner, drafting k tokens
autoregressively (one batched 1-token forward per draft position)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from blockspec.common.contracts import Q_WIDTH, Draft, ProposeInput
from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.runtime.distributions import DraftDist, draft_pick
from blockspec.common.runtime.runner import Runner, Segment

log = logging.getLogger(__name__)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModelProposer:
    method = "draft_model"
    fallbacks = 0  # as a DrafterRole: in the router's process a failure is the step's, never a k = 0 fallback

    def __init__(self, checkpoint: Checkpoint, num_slots: int, max_len: int | None = None, max_k: int = 16,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.runner = Runner(checkpoint, num_slots, max_len, dtype=dtype, device=device)
        self.max_k = max_k
        self._slots: dict[str, int] = {}
        self._cached: dict[str, list[int]] = {}  # token ids whose K/V the draft cache holds, per request

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        self._cached.pop(request_id, None)
        if slot is not None:
            self.runner.cache.release(slot)

    def _catch_up(self, inp: ProposeInput) -> Segment | None:
        """The segment that brings this request's draft cache to its committed tokens (anchor included)."""
        if inp.request_id not in self._slots:
            self._slots[inp.request_id] = self.runner.cache.allocate()
            self._cached[inp.request_id] = []
        slot, cached = self._slots[inp.request_id], self._cached[inp.request_id]
        # Entries past the committed tokens are stale drafts; a retry re-feeds at least the anchor.
        keep = min(common_prefix(cached, inp.token_ids), len(inp.token_ids) - 1)
        if len(inp.token_ids) + inp.k - 1 > self.runner.max_len:
            return None  # no room left in the draft model's context: draft nothing
        del cached[keep:]
        self.runner.cache.set_length(slot, keep)
        new = list(inp.token_ids[keep:])
        cached.extend(new)
        return Segment(slot, new, last_only=True)

    @staticmethod
    def _pick(logits: torch.Tensor, inp: ProposeInput, position: int, q_rows: list) -> int:
        """The next draft token from the draft model's logits [V]; rejection rows keep (ids, q) in q_rows."""
        if inp.sampling.greedy:
            return int(logits.argmax())
        ids = logits.topk(min(Q_WIDTH, logits.shape[-1])).indices  # q lives on the draft model's top tokens
        pick = draft_pick(logits[ids], ids, inp.sampling, position)
        if pick.probs is not None:
            q_rows.append((ids.cpu(), pick.probs))  # q lives on the host
        return int(ids[pick.index])

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]:
        drafts: list[list[int]] = [[] for _ in inputs]
        q_rows: list[list] = [[] for _ in inputs]
        active = []  # (index in inputs, segment to run)
        for idx, inp in enumerate(inputs):
            seg = self._catch_up(inp) if inp.k > 0 else None
            if seg is not None:
                active.append((idx, seg))
        while active:
            out = self.runner.forward([seg for _, seg in active])
            next_active = []
            for (idx, seg), logits in zip(active, out.logits):
                inp = inputs[idx]
                token = self._pick(logits[-1], inp, len(inp.token_ids) + len(drafts[idx]), q_rows[idx])
                drafts[idx].append(token)
                if len(drafts[idx]) < inputs[idx].k:
                    self._cached[inputs[idx].request_id].append(token)
                    next_active.append((idx, Segment(seg.slot, (token,), last_only=True)))
            active = next_active
        return [Draft(tuple(d), DraftDist(torch.stack([i for i, _ in q]), torch.stack([p for _, p in q])) if q else None)
                for d, q in zip(drafts, q_rows)]
