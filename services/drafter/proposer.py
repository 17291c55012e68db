"""The proposer interface: what every drafting method (none, ngram, draft_model, dflash) implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ProposeInput:
    request_id: str
    token_ids: Sequence[int]  # committed tokens, prompt included; the last one is the anchor
    k: int  # number of draft tokens wanted (the proposer may return fewer)


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...]  # at most k draft tokens
    q: torch.Tensor | None = None  # [len, vocab] draft probabilities where the method has them


class Proposer(Protocol):
    """Proposes draft tokens for a batch of requests. State is per request id; `release` drops it.

    A propose for a committed context the proposer has already seen must be idempotent (a retry).
    """

    method: str
    max_k: int

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]: ...

    def release(self, request_id: str) -> None: ...
