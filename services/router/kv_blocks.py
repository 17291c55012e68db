"""The step loop's KV blocks: what admission may count on, and preemption where a step's verifies find too few."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class KvBlocks:
    """`StepLoop`'s part that follows the verifier's KV blocks (its `verifier`, `_waiting`, `_prefilling`, `_running`,
    `_release`, `preemptions`)."""

    def _admission_blocks(self) -> int:
        """The blocks new requests may take now: the free ones, less what the prompts under way still take (all their
        blocks counted: a prompt partly prefilled holds some of them already)."""
        return self.verifier.free_blocks - sum(self._blocks_for(len(lv.token_ids)) for lv in self._prefilling.values())

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.verifier.block_size)

    def _make_room(self, needs: dict[str, int]) -> None:
        """Preempt the latest admitted requests until the step's verifies (`needs`: the new positions of each) find
        their KV blocks, or, with nothing to verify, until the prompts under way can go on: each preempted request
        frees its blocks in both roles and waits at the head of the queue, to resume with every token it had
        committed (its stream goes on from there: nothing is sent twice or lost)."""
        v = self.verifier
        while True:
            if needs:
                short = sum(v.blocks_needed(r, n) for r, n in needs.items() if r in self._running) > v.free_blocks
            else:  # prefill only: stuck where no prompt under way can take a block
                short = bool(self._prefilling) and all(v.blocks_needed(r, 1) > v.free_blocks for r in self._prefilling)
            holders = [*self._running.values(), *self._prefilling.values()]
            if not short or len(holders) <= 1:
                return
            victim = max(holders, key=lambda lv: lv.admitted)
            rid = victim.request.request_id
            self._release(rid)
            self._running.pop(rid, None) or self._prefilling.pop(rid)
            victim.last_drafted = 0
            victim.stats.preempted += 1
            self.preemptions += 1
            self._waiting.appendleft(victim)
            needs = {r: n for r, n in needs.items() if r != rid}
            log.info("preempted request %s at %d tokens (KV blocks: %d free)", rid, len(victim.token_ids),
                     v.free_blocks)
