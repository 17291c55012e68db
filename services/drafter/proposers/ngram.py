"""Method `ngram` (prompt lookup): find the latest earlier occurrence of the context's last n tokens and
propose the tokens that followed it. `lookup` also serves the step loop's prompt lookup in front of a
model drafter (router/step_loop.py, `prompt_lookup`)."""

from __future__ import annotations

from collections.abc import Sequence

from blockspec.services.drafter.proposer import Draft, ProposeInput


def lookup(token_ids: Sequence[int], k: int, max_ngram: int, min_ngram: int, periodic: bool = False,
           text: str | None = None) -> tuple[int, ...]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram.

    A match that ends close to the context's end leaves fewer than k tokens after it. `periodic` then
    continues the repeat it implies: the context read as periodic, with the period the distance between
    the match and the suffix (a model caught in a loop), so every match gives k tokens.
    `text`: the tokens as one character each (`as_text`; `ContextTexts` keeps it per request).
    """
    # One character per token: str.rfind finds the latest match in C, no array per call.
    text = as_text(token_ids) if text is None else text
    end = len(text) - 1  # matches end before the last token: the suffix itself does not count
    for n in range(min(max_ngram, end), min_ngram - 1, -1):
        at = text.rfind(text[-n:], 0, end)
        if at < 0:
            continue
        start = at + n
        found = tuple(token_ids[start : start + k])
        if not periodic or len(found) == k:
            return found
        period = len(text) - start
        return tuple(found[j % period] for j in range(k))
    return ()


def as_text(token_ids: Sequence[int]) -> str:
    return "".join(map(chr, token_ids))


class ContextTexts:
    """Each request's committed tokens as `lookup`'s text, extended by the tokens committed since the last call
    (committed tokens never change; `drop` when the request ends). Built whole, the text of a 4,000-token
    context took 0.15 ms a call here, a step's lookup as much again."""

    def __init__(self) -> None:
        self._texts: dict[str, str] = {}

    def of(self, request_id: str, token_ids: Sequence[int]) -> str:
        text = self._texts.get(request_id, "")
        if len(text) > len(token_ids):  # not this request's: its id was reused without a drop
            text = ""
        if len(text) < len(token_ids):
            text += as_text(token_ids[len(text) :])
            self._texts[request_id] = text
        return text

    def drop(self, request_id: str) -> None:
        self._texts.pop(request_id, None)


class NgramProposer:
    method = "ngram"

    def __init__(self, max_k: int = 16, max_ngram: int = 3, min_ngram: int = 1, periodic: bool = True) -> None:
        self.max_k = max_k
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # A match that runs into the context's end continues as a loop: on the default pair's held-out prompts
        # tau 2.93 at k=5 and 3.21 at k=7, against 2.35 and 2.41 with the tokens after the match alone.
        self.periodic = periodic
        self._texts = ContextTexts()

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]:
        return [Draft(lookup(i.token_ids, i.k, self.max_ngram, self.min_ngram, self.periodic,
                             self._texts.of(i.request_id, i.token_ids))) for i in inputs]

    def release(self, request_id: str) -> None:
        self._texts.drop(request_id)
