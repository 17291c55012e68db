"""Stop sequences over a text stream: hold back what could still become a stop sequence."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._held = ""  # text not yet released: it may be the start of a stop sequence
        self._keep = max((len(s) for s in stops), default=1) - 1

    def push(self, delta: str) -> tuple[str, bool]:
        """New text in -> (text safe to release, whether a stop sequence was hit).

        On a hit the released text ends right before the stop sequence, which is never released.
        """
        text = self._held + delta
        # The stop sequence that ends first, as if the text came one character at a time: a step of several tokens
        # (speculation) must cut where one token a step (the target alone) does. Two ending at once: the longer.
        hits = [(i + len(s), i) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)[1]], True
        cut = max(0, len(text) - self._keep) if self.stops else len(text)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """End of stream: what was held back is plain text after all."""
        held, self._held = self._held, ""
        return held

    def finish(self, delta: str) -> tuple[str, bool]:
        """The stream's last text in -> (the rest to release, whether a stop sequence completed in it); held text is
        released unless a stop sequence cut it."""
        released, hit = self.push(delta)
        return (released, True) if hit else (released + self.flush(), False)
