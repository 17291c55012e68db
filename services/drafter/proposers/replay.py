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

    fallbacks = 0  # as a DrafterRole: in the router's process a failure is the step's, never a k = 0 fallback

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


class FixedAcceptanceProposer:
    """Drafts a known continuation (each request's tokens from plain decoding, prompt included) with a set
    acceptance: the i-th new context of a request gets k tokens of its continuation, the one at index
    `schedule[i % len(schedule)]` changed, so a greedy verify accepts exactly that many (tau = mean(schedule) + 1
    where k is above them). It costs nothing: what the step loop and the target cost at that acceptance, whatever
    the weights (gpu-check's speculative throughput). A repeated context gets its first draft again."""

    fallbacks = 0  # as a DrafterRole: in the router's process a failure is the step's, never a k = 0 fallback
    method = "replay"

    def __init__(self, streams: dict[str, Sequence[int]], max_k: int, vocab_size: int,
                 schedule: Sequence[int] = (2, 3, 3, 2, 3)) -> None:
        self.streams, self.max_k, self.vocab_size, self.schedule = streams, max_k, vocab_size, tuple(schedule)
        self._steps: dict[str, int] = {}
        self._drafts: dict[tuple[str, int], Draft] = {}

    @property
    def tau(self) -> float:
        return sum(self.schedule) / len(self.schedule) + 1

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]:
        out = []
        for i in inputs:
            key = (i.request_id, len(i.token_ids))
            if key not in self._drafts:
                step = self._steps.get(i.request_id, 0)
                self._steps[i.request_id] = step + 1
                tokens = list(self.streams[i.request_id][len(i.token_ids) : len(i.token_ids) + i.k])
                wrong = self.schedule[step % len(self.schedule)]
                if wrong < len(tokens):
                    tokens[wrong] = (tokens[wrong] + 1) % self.vocab_size
                self._drafts[key] = Draft(tuple(tokens))
            out.append(self._drafts[key])
        return out

    def release(self, request_id: str) -> None:
        self._steps.pop(request_id, None)
        self._drafts = {key: d for key, d in self._drafts.items() if key[0] != request_id}
