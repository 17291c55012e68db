"""N-gram lookup over a request's committed tokens: the tokens that followed the latest earlier occurrence of
the context's last n tokens. The `ngram` proposer drafts with it, and the router's step loop runs it in front of a
model drafter (prompt lookup)."""

from __future__ import annotations

from collections.abc import Sequence


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
    (committed tokens never change; `drop` when the request ends). Built whole every call, the text of a long
    context costs as much as the step's lookup itself."""

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
