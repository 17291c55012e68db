"""Method `none`: no drafts, so every step is plain decoding through the same verifier path."""

from __future__ import annotations

from collections.abc import Sequence

from blockspec.common.contracts import Draft, ProposeInput


class NoneProposer:
    method = "none"
    max_k = 0
    fallbacks = 0  # as a DrafterRole: in the router's process a failure is the step's, never a k = 0 fallback

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]:
        return [Draft(()) for _ in inputs]

    def release(self, request_id: str) -> None:
        pass
