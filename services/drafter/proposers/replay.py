"""A drafter that costs nothing: another proposer's drafts, recorded over one run and given back in the next
(the bench's `:replay` modes measure the step loop at that drafter's acceptance without its cost)."""

from __future__ import annotations

from collections.abc import Sequence

from blockspec.common.contracts import Draft, ProposeInput, Proposer

_NONE = Draft(())


class ReplayProposer:
    """Records `live`'s drafts by (committed tokens, k) while `recording`, then answers from the record alone.
    Greedy outputs do not depend on the drafts, so a second run over the same prompts asks for the same
    contexts; one that was never recorded gets no draft and is counted in `misses`."""

    def __init__(self, live: Proposer) -> None:
        self.live, self.method, self.max_k = live, live.method, live.max_k
        self.recording = True
        self.misses = 0
        self._book: dict[tuple[tuple[int, ...], int], Draft] = {}

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]:
        if self.recording:
            drafts = self.live.propose(inputs)
            self._book.update(((tuple(i.token_ids), i.k), d) for i, d in zip(inputs, drafts))
            return drafts
        drafts = [self._book.get((tuple(i.token_ids), i.k)) for i in inputs]
        self.misses += sum(d is None for d in drafts)
        return [_NONE if d is None else d for d in drafts]

    def release(self, request_id: str) -> None:
        self.live.release(request_id)
