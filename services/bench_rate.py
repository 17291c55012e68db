"""`blockspec bench --request-rates`: open-loop passes, as vLLM's serving benchmark sends requests with a request
rate. Requests arrive at random times (a Poisson process, one seeded schedule that every mode gets), whether or
not the engine has kept up; at most a fixed number are in flight and the rest wait for a slot. TTFT counts from
the arrival, that wait included: the latency a client at that load sees."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

ARRIVAL_SEED = 0  # the same arrival times for every mode and round: the modes meet the same load


def arrival_times(n: int, rate: float, seed: int = ARRIVAL_SEED) -> list[float]:
    """Seconds into a pass at which each of n requests arrives: the first at 0, then exponential gaps of mean
    1 / rate (a Poisson process of `rate` requests per second)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def open_loop(loop, requests: Sequence, arrivals: Sequence[float], started: float) -> tuple[list, dict[str, float]]:
    """Step `loop` (router/step_loop.StepLoop) while submitting request i once arrivals[i] seconds have passed since
    `started`; idle until the next arrival when nothing runs. Returns the finish events and, per request id, how
    long after its arrival it was submitted (a step was running when it arrived): its TTFT counts that too."""
    from blockspec.services.router.step_loop import FinishEvent

    done, late, i = [], {}, 0
    while i < len(requests) or not loop.idle:
        now = time.perf_counter() - started
        while i < len(requests) and arrivals[i] <= now:
            loop.submit(requests[i])
            late[requests[i].request_id] = now - arrivals[i]
            i += 1
        if loop.idle:
            time.sleep(max(arrivals[i] - now, 0.0))
            continue
        done += [e for e in loop.step() if isinstance(e, FinishEvent)]
    return done, late
