"""Drives the step loop for an asyncio server: requests in, one event queue per request out.

The step loop runs on a thread of its own, step after step while it has work: submit / cancel run there
between steps (the step loop needs no locks), a slow forward never blocks the event loop, and the next step
does not wait for the event loop to take the last one's events (a round trip through it is a noticeable share of
a served step at concurrency 1). A prompt's first token is handed over as soon as its prefill is done, before the
step's speculative round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from blockspec.common.telemetry.metrics import ROLE_MEMORY_MAX_AGE_S, RouterMetrics, process_memory
from blockspec.services.router.step_loop import FinishEvent, Load, Request, StepLoop, StepReport, TokenEvent

log = logging.getLogger(__name__)

WINDOW_STEPS = 64  # acceptance rate and tau gauges: over this many recent steps
LOG_INTERVAL_S = 10.0  # the periodic stats line
STOP_WAIT_S = 30.0  # stop(): how long the step in flight may take to finish


@dataclass(frozen=True)
class Stream:
    """A submitted request as its caller holds it: its events, and the key to cancel it by (not its request_id,
    which a later stream may take as soon as this one has finished)."""

    key: str  # `request_id#n`: the step loop's id for the request
    events: asyncio.Queue  # TokenEvent | FinishEvent


@dataclass(frozen=True)
class _StepDone:
    """A finished step as the step thread saw it (the next one may be under way when the event loop takes it)."""

    report: StepReport | None
    load: Load


class Scheduler:
    def __init__(self, step_loop: StepLoop, metrics: RouterMetrics | None = None, replica: int = 0) -> None:
        self.step_loop = step_loop
        self.metrics = metrics
        self.replica = str(replica)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (fn, args, future) for the step thread; None: stop
        self._thread: threading.Thread | None = None
        self._events_loop: asyncio.AbstractEventLoop | None = None
        # The step loop knows a request by a key of its own, `request_id#n`: a client may reuse a request_id as soon
        # as its stream has ended, while the old request runs on until its cancel's turn between steps, and neither
        # stream gets the other's events.
        self._keys: dict[str, str] = {}  # request_id of a live stream -> its key
        self._queues: dict[str, asyncio.Queue[TokenEvent | FinishEvent]] = {}  # key -> the stream's events
        self._serial = 0
        self.step_started: float | None = None  # monotonic time of the step in flight (watchdog)
        self.lost_at = -math.inf  # monotonic time of the last step that found a role's process gone
        self.waiting = 0  # requests waiting for a slot or prefilling, at the last step (autoscaling's signal)
        self._fallbacks_seen = 0
        self.steps = 0
        self._counted = (0, 0, 0)  # prefix cache queries, hits and preemptions already counted
        self._window: deque = deque(maxlen=WINDOW_STEPS)  # recent step reports
        self._interval_tokens = 0
        self._interval_started = time.monotonic()

    @property
    def load(self) -> int:
        """Requests this replica holds (queued, running, or submitted and not finished)."""
        return len(self._queues)

    async def start(self) -> None:
        self._events_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._drive, name=f"step-loop-{self.replica}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._jobs.put(None)
        await asyncio.to_thread(self._thread.join, STOP_WAIT_S)
        self._thread = None
        while not self._jobs.empty():  # submitted after the stop: never run
            job = self._jobs.get()
            if job is not None and not job[2].done():
                job[2].set_exception(RuntimeError("the scheduler has stopped"))

    def _job(self, fn, *args) -> asyncio.Future:
        """fn(*args) queued for the step thread, between two steps: its result comes on the returned future."""
        future = asyncio.get_running_loop().create_future()
        self._jobs.put((fn, args, future))
        return future

    async def submit(self, request: Request) -> Stream:
        """Queue a request; its events come on the returned stream. A caller cancelled while the submit waits for
        the step in flight leaves nothing behind: the request is cancelled right after it joins."""
        rid = request.request_id
        if rid in self._keys:
            raise ValueError(f"request {rid!r} is already running")
        self._serial += 1
        key = self._keys[rid] = f"{rid}#{self._serial}"
        stream = Stream(key, asyncio.Queue())
        self._queues[key] = stream.events
        try:
            await self._job(self.step_loop.submit, replace(request, request_id=key))
        except asyncio.CancelledError:  # the submit job runs all the same: a cancel job after it
            self._cancel_job(key)
            raise
        except BaseException:
            self._forget(key)
            raise
        return stream

    async def cancel(self, key: str) -> FinishEvent | None:
        """Stop a stream's request (client gone, deadline, stop sequence) and free its KV slots in both roles. None:
        it had finished already, and its FinishEvent is on the stream's queue by the time this returns."""
        future = self._cancel_job(key)
        return None if future is None else await future

    def _cancel_job(self, key: str) -> asyncio.Future | None:
        """Free the stream's request_id now and queue the step loop's cancel of its key (None: it has finished). Its
        queue takes the events of the steps before the cancel's turn, then is dropped."""
        if key not in self._queues:
            return None
        self._forget(key, keep_queue=True)

        def done(f: asyncio.Future) -> None:  # the job has run (or never will): drop the queue; an error is seen
            self._queues.pop(key, None)  # here too, for a cancel nobody awaits (a client gone during its submit)
            if not f.cancelled():
                f.exception()

        future = self._job(self.step_loop.cancel, key)
        future.add_done_callback(done)
        return future

    def _forget(self, key: str, keep_queue: bool = False) -> None:
        """The key's request_id is free again (if the key still holds it); its queue is dropped unless kept."""
        rid = key.rpartition("#")[0]
        if self._keys.get(rid) == key:
            del self._keys[rid]
        if not keep_queue:
            self._queues.pop(key, None)

    # The step thread.

    def _drive(self) -> None:
        """Jobs first (they change what the next step runs; none waiting and nothing to step: wait for one), then
        one step; until stop() (after the step in flight), which cancels what is left so that the roles free it."""
        while True:
            try:
                job = self._jobs.get(block=self.step_loop.idle)
            except queue.Empty:
                self._step()
                continue
            if job is None:
                try:
                    self.step_loop.cancel_all()
                except Exception:  # noqa: BLE001 - a role that is gone holds nothing
                    log.debug("cancelling the requests left at stop failed", exc_info=True)
                return
            self._run_job(*job)

    def _run_job(self, fn, args, future: asyncio.Future) -> None:
        try:
            result, error = fn(*args), None
        except Exception as e:  # handed to the awaiting coroutine
            result, error = None, e
        self._post(_settle, future, result, error)
        self._post(self._set_load, self.step_loop.load)  # a submit or a cancel

    def _step(self) -> None:
        loop = self.step_loop
        self.step_started = time.monotonic()
        try:
            events = loop.step(emit=lambda first: self._post(self._deliver, first, None))
        except Exception as error:
            gone = role_gone(error)
            if gone:
                self.lost_at = time.monotonic()  # new requests go to the other replicas from now on (`lost`)
            log.exception("step failed (%s); failing the running requests", "a role is gone" if gone else "an error")
            reason = "unavailable" if gone else "error"
            events = [FinishEvent(e.request_id, reason, e.token_ids, e.stats) for e in loop.cancel_all()]
            self._post(self._deliver_failed, events, loop.load)
            return
        finally:
            self.step_started = None
        self._post(self._deliver, events, _StepDone(loop.last_report, loop.load))

    def _post(self, fn, *args) -> None:
        try:
            self._events_loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is listening
            pass

    # The event loop.

    def _deliver(self, events: list, done: _StepDone | None) -> None:
        """Events to their requests' queues; done: the step's end (its metrics), None for first tokens."""
        if done is not None:
            self.steps += 1
        self._observe(events, done)
        for event in events:
            queue_ = self._queues.get(event.request_id)
            if queue_ is not None:
                queue_.put_nowait(event)
            if isinstance(event, FinishEvent):
                self._forget(event.request_id)

    def _deliver_failed(self, events: list, load: Load) -> None:
        """A failed step's ends: the load gauges first (all cancelled), then the streams, in one callback, so a client
        that sees its stream fail never reads the failed requests in the gauges."""
        self._set_load(load)
        self._deliver(events, None)

    def _observe(self, events: list, done: _StepDone | None) -> None:
        m, loop = self.metrics, self.step_loop
        if m is None:
            return
        replica = self.replica
        tokens = sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent))
        m.generation_tokens.inc(tokens)
        self._interval_tokens += tokens
        if done is None:
            return
        m.steps.inc()
        self._set_load(done.load)
        report = done.report
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
        fallbacks = loop.drafter.fallbacks
        if fallbacks > self._fallbacks_seen:
            m.drafter_fallbacks.inc(fallbacks - self._fallbacks_seen)
            self._fallbacks_seen = fallbacks
        stats = getattr(loop.verifier, "prefix_stats", None)
        if stats is not None:
            now = (stats.queries, stats.hits, loop.preemptions)
            for counter, new, old in zip((m.prefix_cache_queries, m.prefix_cache_hits, m.num_preemptions), now,
                                         self._counted):
                if new > old:
                    counter.labels(replica=replica).inc(new - old)
            self._counted = now
        for role_name, (rss, gpu) in _role_memory(loop):
            if rss:
                m.role_memory.labels(replica=replica, role=role_name, kind="rss").set(rss)
                m.role_memory.labels(replica=replica, role=role_name, kind="gpu").set(gpu)
        self._log_stats()

    def _set_load(self, load: Load) -> None:
        self.waiting = load.waiting
        if self.metrics is not None:
            m, replica = self.metrics, self.replica
            m.requests_running.labels(replica=replica).set(load.running)
            m.requests_waiting.labels(replica=replica).set(load.waiting)
            m.kv_slots_used.labels(replica=replica).set(load.slots)
            # vLLM's kv_cache_usage_perc: the share of the KV cache's blocks (a slot cache's: slots) requests hold
            m.kv_cache_usage.labels(replica=replica).set(load.kv_usage)

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

    @property
    def lost(self) -> bool:
        """Whether a step found one of its roles' processes gone within LOST_HOLD_S: its requests ended UNAVAILABLE,
        and new ones go elsewhere while the supervisor replaces it."""
        return time.monotonic() - self.lost_at < LOST_HOLD_S

    def stalled(self, limit_s: float) -> bool:
        """True when a step has been running for longer than limit_s: the engine is not making progress."""
        started = self.step_started
        return started is not None and time.monotonic() - started > limit_s


LOST_HOLD_S = 10.0  # a replica whose step found a role gone takes no new request this long (the supervisor replaces it)


def role_gone(error: BaseException) -> bool:
    """A step that failed because a role's process is gone (its stream UNAVAILABLE): the requests may be retried
    elsewhere, unlike a failure inside the engine."""
    import grpc

    return isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # its caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _role_memory(loop: StepLoop) -> list[tuple[str, tuple[int, int]]]:
    """(role, (rss, gpu) bytes) of the loop's roles, as their processes last reported them; where both run in this
    process (`serve --inprocess`), this process's own, as role "server"."""
    memory = [(name, getattr(role, "memory", None)) for name, role in (("verifier", loop.verifier),
                                                                      ("drafter", loop.drafter))]
    if all(mem is None for _, mem in memory):
        return [("server", process_memory(ROLE_MEMORY_MAX_AGE_S))]
    return [(name, mem or (0, 0)) for name, mem in memory]
