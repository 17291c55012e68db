"""Method `ngram` (prompt lookup): propose the tokens that followed the latest earlier occurrence of the
context's last n tokens (common/tokens/lookup.py)."""

from __future__ import annotations

from collections.abc import Sequence

from blockspec.common.contracts import Draft, ProposeInput
from blockspec.common.tokens.lookup import ContextTexts, lookup


class NgramProposer:
    method = "ngram"
    fallbacks = 0  # as a DrafterRole: in the router's process a failure is the step's, never a k = 0 fallback

    def __init__(self, max_k: int = 16, max_ngram: int = 3, min_ngram: int = 1, periodic: bool = True) -> None:
        self.max_k = max_k
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # A match that runs into the context's end continues as a loop: on the default pair's held-out prompts
        # a clearly higher tau than the tokens after the match alone give.
        self.periodic = periodic
        self._texts = ContextTexts()

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]:
        return [Draft(lookup(i.token_ids, i.k, self.max_ngram, self.min_ngram, self.periodic,
                             self._texts.of(i.request_id, i.token_ids))) for i in inputs]

    def release(self, request_id: str) -> None:
        self._texts.drop(request_id)
