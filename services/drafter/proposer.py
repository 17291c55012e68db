"""The proposer interface: what every drafting method (none, ngram, draft_model, dflash) implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from blockspec.common.sampling import GREEDY, DraftDist, SamplingParams


@dataclass(frozen=True)
class ProposeInput:
    request_id: str
    token_ids: Sequence[int]  # committed tokens, prompt included; the last one is the anchor
    k: int  # number of draft tokens wanted (the proposer may return fewer)
    sampling: SamplingParams = GREEDY  # how the request samples: drafts follow it (see common/sampling.py)


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...]  # at most k draft tokens
    # Rejection rule: the distribution each token was sampled from. None: the tokens are deterministic
    # given the context (greedy, strict, n-gram), which the rule treats as a one-hot q.
    q: DraftDist | None = None
    q_width: int = 0  # remote drafter: q sits in the verifier's shared q buffer, rows this wide

    def head(self, k: int) -> Draft:
        if self.q is None and len(self.token_ids) <= k:  # nothing to cut (the step loop's usual case)
            return self
        return Draft(self.token_ids[:k], self.q.head(k) if self.q is not None else None, self.q_width)


class Proposer(Protocol):
    """Proposes draft tokens for a batch of requests. State is per request id; `release` drops it.

    A propose for a committed context the proposer has already seen must be idempotent (a retry).
    """

    method: str
    max_k: int

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]: ...

    def release(self, request_id: str) -> None: ...
