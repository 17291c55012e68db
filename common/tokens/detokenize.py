"""Incremental detokenization: turn a growing list of token ids into text deltas, never splitting a character."""

from __future__ import annotations

from collections.abc import Sequence


def decode(tokenizer: object, token_ids: Sequence[int]) -> str:
    """The one decoding rule (specials dropped, no space clean-up) shared by streams and final texts."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


class TextStream:
    """Feed committed token ids, get back only the new text; holds back an incomplete UTF-8 sequence.

    Decodes a short window (the previous delta's tokens + the new ones), not the whole text, so a
    long stream costs O(new tokens) per push.
    """

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been returned

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = decode(self._tokenizer, self._ids[self._prefix : self._read])
        text = decode(self._tokenizer, self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""  # nothing printable yet, or a multi-byte character is still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is left at the end of the stream, incomplete characters included."""
        prefix_text = decode(self._tokenizer, self._ids[self._prefix : self._read])
        text = decode(self._tokenizer, self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]
