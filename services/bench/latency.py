"""`blockspec bench`'s latencies, as vLLM's serving benchmark reports them: time to first token (TTFT), time per
output token after the first (TPOT) and inter-token latency (ITL), for the engine's passes and `--server`'s."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np


def latency(ttft_s: Sequence[float], decodes: Sequence[tuple[float, int]],
            gaps_s: Sequence[float] = ()) -> dict[str, float | None]:
    """Row fields from each request's time to first token, its decode (seconds from the first token to the
    last, tokens after the first) and the gaps between its chunks (ChunkGaps). TPOT is the decode time over the
    tokens, all requests summed, so the prefill stays out of it as it stays out of the ceiling tau / r(k+1); the
    percentiles are numpy's (linear), as vLLM's serving benchmark reports them."""
    seconds, tokens = sum(d for d, _ in decodes), sum(n for _, n in decodes)
    per_request = [d / n for d, n in decodes if n]

    def ms(values: Sequence[float], q: float) -> float | None:
        return float(np.percentile(values, q)) * 1e3 if len(values) else None

    return {"ttft_ms": ms(ttft_s, 50), "ttft_p99_ms": ms(ttft_s, 99),
            "tpot_ms": seconds / tokens * 1e3 if tokens else None, "tpot_p99_ms": ms(per_request, 99),
            "itl_ms": ms(gaps_s, 50), "itl_p99_ms": ms(gaps_s, 99)}


class ChunkGaps:
    """Inter-token latency as vLLM's serving benchmark takes it: the seconds between two consecutive chunks of
    tokens that one stream receives (with speculation a chunk holds a step's tokens, so the gaps show how evenly
    the text arrives, where TPOT averages it). `saw` each chunk as it arrives; `gaps` pools every stream's."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._last: dict[str, float] = {}

    def saw(self, stream: str, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if stream in self._last:
            self.gaps.append(now - self._last[stream])
        self._last[stream] = now

    def saw_events(self, events: Sequence) -> None:
        """A step loop's events: each TokenEvent with tokens is a chunk of its request's stream."""
        from blockspec.services.router.step_loop import TokenEvent

        now = time.perf_counter()
        for e in events:
            if isinstance(e, TokenEvent) and e.token_ids:
                self.saw(e.request_id, now)
