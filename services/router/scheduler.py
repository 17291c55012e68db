"""Drives the step loop for an asyncio server: requests in, one event queue per request out.

submit / cancel / step all run on one dedicated thread, so the step loop needs no locks and a slow
forward never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from blockspec.common.telemetry import RouterMetrics
from blockspec.services.router.step_loop import FinishEvent, Request, StepLoop, TokenEvent

log = logging.getLogger(__name__)

WINDOW_STEPS = 64  # acceptance rate and tau gauges: over this many recent steps
LOG_INTERVAL_S = 10.0  # the periodic stats line


class Scheduler:
    def __init__(self, step_loop: StepLoop, metrics: RouterMetrics | None = None, replica: int = 0) -> None:
        self.step_loop = step_loop
        self.metrics = metrics
        self.replica = str(replica)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-loop")
        self._queues: dict[str, asyncio.Queue[TokenEvent | FinishEvent]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.step_started: float | None = None  # monotonic time of the step in flight (watchdog)
        self._fallbacks_seen = 0
        self.steps = 0
        self._window: deque = deque(maxlen=WINDOW_STEPS)  # recent step reports
        self._interval_tokens = 0
        self._interval_started = time.monotonic()

    @property
    def load(self) -> int:
        """Requests this replica holds (queued, running, or submitted and not finished)."""
        return len(self._queues)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="step-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def submit(self, request: Request) -> asyncio.Queue[TokenEvent | FinishEvent]:
        if request.request_id in self._queues:
            raise ValueError(f"request {request.request_id!r} is already running")
        queue: asyncio.Queue[TokenEvent | FinishEvent] = asyncio.Queue()
        self._queues[request.request_id] = queue
        await self._call(self.step_loop.submit, request)
        self._wake.set()
        return queue

    async def cancel(self, request_id: str) -> FinishEvent | None:
        """Stop a request (client gone, deadline, stop sequence) and free its KV slots in both roles."""
        self._queues.pop(request_id, None)
        return await self._call(self.step_loop.cancel, request_id)

    async def _run(self) -> None:
        while True:
            if self.step_loop.idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.step_started = time.monotonic()
            try:
                events = await self._call(self.step_loop.step)
                self.steps += 1
            except Exception:
                log.exception("step failed; failing the running requests")
                await self._fail_all()
                continue
            finally:
                self.step_started = None
            self._observe(events)
            for event in events:
                queue = self._queues.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)
                if isinstance(event, FinishEvent):
                    self._queues.pop(event.request_id, None)

    def _observe(self, events: list) -> None:
        m, loop = self.metrics, self.step_loop
        if m is None:
            return
        replica = self.replica
        m.steps.inc()
        m.requests_running.labels(replica=replica).set(loop.num_running)
        m.requests_waiting.labels(replica=replica).set(loop.num_waiting)
        m.kv_slots_used.labels(replica=replica).set(loop.num_running)
        tokens = sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent))
        m.generation_tokens.inc(tokens)
        self._interval_tokens += tokens
        report = loop.last_report
        if report is not None:
            m.num_drafts.inc(report.drafts)
            m.num_lookup_drafts.inc(report.looked_up)
            m.num_draft_tokens.inc(report.draft_tokens)
            m.num_accepted_tokens.inc(report.accepted_tokens)
            for pos, n in enumerate(report.accepted_per_pos):
                m.accepted_per_pos.labels(position=str(pos)).inc(n)
            self._window.append(report)
            m.mean_k.labels(replica=replica).set(report.mean_k)
            drafted = sum(r.draft_tokens for r in self._window)
            accepted = sum(r.accepted_tokens for r in self._window)
            if drafted:
                m.acceptance_rate.labels(replica=replica).set(accepted / drafted)
            m.tau.labels(replica=replica).set(1 + accepted / sum(r.batch_size for r in self._window))
        fallbacks = getattr(loop.drafter, "fallbacks", 0)
        if fallbacks > self._fallbacks_seen:
            m.drafter_fallbacks.inc(fallbacks - self._fallbacks_seen)
            self._fallbacks_seen = fallbacks
        for role_name, role in (("verifier", loop.verifier), ("drafter", loop.drafter)):
            rss, gpu = getattr(role, "memory", (0, 0))
            if rss:
                m.role_memory.labels(replica=replica, role=role_name, kind="rss").set(rss)
                m.role_memory.labels(replica=replica, role=role_name, kind="gpu").set(gpu)
        self._log_stats()

    def _log_stats(self) -> None:
        """Every LOG_INTERVAL_S: one structured (key=value) line an SRE can grep or parse."""
        now = time.monotonic()
        if now - self._interval_started < LOG_INTERVAL_S:
            return
        drafted = sum(r.draft_tokens for r in self._window)
        accepted = sum(r.accepted_tokens for r in self._window)
        rate = self._interval_tokens / (now - self._interval_started)
        self.metrics.tokens_per_s.labels(replica=self.replica).set(rate)
        log.info("stats replica=%s acceptance_rate=%s tau=%.3f tokens_per_s=%.1f queue_depth=%d running=%d "
                 "fallbacks=%d", self.replica, f"{accepted / drafted:.3f}" if drafted else "none",
                 1 + accepted / max(1, sum(r.batch_size for r in self._window)), rate, self.step_loop.num_waiting,
                 self.step_loop.num_running, self._fallbacks_seen)
        self._interval_tokens, self._interval_started = 0, now

    def stalled(self, limit_s: float) -> bool:
        """True when a step has been running for longer than limit_s: the engine is not making progress."""
        started = self.step_started
        return started is not None and time.monotonic() - started > limit_s

    async def _fail_all(self) -> None:
        for request_id in list(self._queues):
            queue = self._queues.pop(request_id)
            event = await self._call(self.step_loop.cancel, request_id)
            if event is not None:
                queue.put_nowait(FinishEvent(request_id, "error", event.token_ids, event.stats))
