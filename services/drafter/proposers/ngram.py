"""Method `ngram` (prompt lookup): find the latest earlier occurrence of the context's last n tokens and
propose the tokens that followed it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from blockspec.services.drafter.proposer import Draft, ProposeInput


def lookup(token_ids: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, ...]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [L - n, n]; excludes the suffix itself
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(int(t) for t in ids[start : start + k])
    return ()


class NgramProposer:
    method = "ngram"

    def __init__(self, max_k: int = 16, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_k = max_k
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]:
        return [Draft(lookup(i.token_ids, i.k, self.max_ngram, self.min_ngram)) for i in inputs]

    def release(self, request_id: str) -> None:
        pass
