"""`blockspec bench --request-rates`: open-loop passes, as vLLM's serving benchmark sends requests with a request
rate. Requests arrive at random times (a Poisson process, one seeded schedule that every mode gets), whether or
not the engine has kept up; at most a fixed number are in flight and the rest wait for a slot. TTFT counts from
the arrival, that wait included: the latency a client at that load sees."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from blockspec.common.errors import InvalidArgument
from blockspec.services.bench.latency import ChunkGaps

ARRIVAL_SEED = 0  # the same arrival times for every mode and round: the modes meet the same load
MAX_ARRIVAL_SPAN_S = 3600.0  # a rate whose pass would take longer to arrive is refused (a rate mistyped, not a load)


def arrival_times(n: int, rate: float, seed: int = ARRIVAL_SEED) -> list[float]:
    """Seconds into a pass at which each of n requests arrives: the first at 0, then exponential gaps of mean
    1 / rate (a Poisson process of `rate` requests per second)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def check_rates(rates: Sequence[float], requests: int) -> None:
    """Refuse, naming --request-rates, a rate at which a pass's `requests` would arrive over more than
    MAX_ARRIVAL_SPAN_S (the seeded schedule's last arrival): --request-rates 0.001 would have run for days."""
    unit_span = arrival_times(requests, 1.0)[-1]  # the schedule scales as 1 / rate
    for rate in rates:
        if unit_span / rate > MAX_ARRIVAL_SPAN_S:
            raise InvalidArgument("--request-rates", f"at {rate:g} requests/s the {requests} requests of a pass would "
                                                     f"arrive over {unit_span / rate:.0f} s, past the "
                                                     f"{MAX_ARRIVAL_SPAN_S:.0f} s allowed: at least "
                                                     f"{unit_span / MAX_ARRIVAL_SPAN_S:.3g} requests/s")


def open_loop(loop, requests: Sequence, arrivals: Sequence[float], started: float,
              chunks: ChunkGaps | None = None) -> tuple[list, dict[str, float]]:
    """Step `loop` (router/step_loop.StepLoop) while submitting request i once arrivals[i] seconds have passed since
    `started`; idle until the next arrival when nothing runs. Returns the finish events and, per request id, how
    long after its arrival it was submitted (a step was running when it arrived): its TTFT counts that too.
    chunks: sees every step's events as they come (the streams' ITL)."""
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
        events = loop.step()
        if chunks is not None:
            chunks.saw_events(events)
        done += [e for e in events if isinstance(e, FinishEvent)]
    return done, late
