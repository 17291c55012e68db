"""One Generate call's stream: the request submitted to a replica's scheduler, each step's tokens detokenized and
checked against the stop sequences, one response message per step, the finish message last. A stream that ends
before its request finishes (the client cancelled, a deadline passed) cancels it on the replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
from opentelemetry.trace import Status, StatusCode

from blockspec.common.sampling import TokenLogprob
from blockspec.common.telemetry import tracing
from blockspec.common.telemetry.metrics import RouterMetrics
from blockspec.common.tokens.detokenize import TextStream
from blockspec.common.wire import logprobs as wire_logprobs
from blockspec.protos import api_pb2
from blockspec.services.router.admission import Admission
from blockspec.services.router.messages import finish_message
from blockspec.services.router.scheduler import Scheduler, Stream
from blockspec.services.router.step_loop import FinishEvent
from blockspec.services.router.stops import StopMatcher

Abort = Callable[[grpc.StatusCode, str], Awaitable[None]]  # ends the call with a status (raises)


class StreamClock:
    """Latency of one stream as the client sees it: TTFT, then per-message gaps (-> metrics)."""

    def __init__(self, metrics: RouterMetrics | None) -> None:
        self.metrics, self.started = metrics, time.perf_counter()
        self.last: float | None = None
        self.ttft_s: float | None = None

    def sent(self, num_tokens: int) -> None:
        now, m = time.perf_counter(), self.metrics
        if num_tokens and self.last is None:
            self.ttft_s = now - self.started
            if m is not None:
                m.time_to_first_token.observe(self.ttft_s)
        elif num_tokens and m is not None:
            gap = now - self.last
            m.inter_chunk_gap.observe(gap)
            for _ in range(num_tokens):
                m.inter_token_latency.observe(gap / num_tokens)
        if num_tokens:
            self.last = now


class RequestStream:
    """The responses of one admitted request on `scheduler`'s replica; `abort` ends the call with a gRPC status."""

    def __init__(self, admission: Admission, scheduler: Scheduler, tokenizer, stops: list[str], span,
                 metrics: RouterMetrics | None, abort: Abort) -> None:
        self.admission, self.scheduler, self.span, self.metrics, self.abort = admission, scheduler, span, metrics, abort
        self.request, self.tokenizer = admission.request, tokenizer
        self.clock = StreamClock(metrics)
        self.text, self.stops = TextStream(tokenizer), StopMatcher(stops)
        self.finished = False

    async def responses(self, started_ns: int) -> AsyncIterator[api_pb2.GenerateResponse]:
        stream = await self._submit()
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(self.request.prompt_ids))
        try:
            while True:
                event = await stream.events.get()
                total_ns = time.perf_counter_ns() - started_ns
                if isinstance(event, FinishEvent):
                    yield await self._last(event, total_ns)
                    return
                delta, hit = self.stops.push(self.text.push(event.token_ids))
                self.clock.sent(len(event.token_ids))
                self.admission.sent += len(event.token_ids)
                if not hit:
                    yield self._message(event.token_ids, delta, total_ns, logprobs=event.logprobs)
                    continue
                self.finished = True
                final = await self._stop(stream)
                yield self._message(event.token_ids, delta, total_ns, self._finish(final, "stop_sequence"),
                                    event.logprobs)
                return
        finally:
            self.admission.release()  # at once, as the scheduler frees it (a client may resend under its id now)
            if not self.finished:  # client cancelled or deadline exceeded: free the slots in both roles
                self.span.set_attribute(tracing.ATTR_FINISH_REASON, "cancelled")
                if self.metrics is not None:
                    self.metrics.requests_finished.labels(reason="cancelled").inc()
                await asyncio.shield(self.scheduler.cancel(stream.key))

    def _message(self, token_ids, text: str, total_ns: int, finish: api_pb2.Finish | None = None,
                 logprobs: Sequence[TokenLogprob] = ()) -> api_pb2.GenerateResponse:
        return api_pb2.GenerateResponse(request_id=self.request.request_id, token_ids=token_ids, text=text,
                                        total_ns=total_ns, finish=finish,
                                        logprobs=wire_logprobs.to_pb(logprobs, self._token_text, token_ids))

    def _token_text(self, token_id: int) -> str:
        """A token's text, decoded alone (specials kept: an end-of-sequence token is named)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    async def _submit(self) -> Stream:
        try:
            return await self.scheduler.submit(self.request)
        except ValueError as e:  # no replica took it: its prompt's tokens come back too
            self.admission.prompt_spent = False
            await self.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {e}")

    async def _last(self, event: FinishEvent, total_ns: int) -> api_pb2.GenerateResponse:
        """The message of a request that finished on its replica (or the abort of one that failed there)."""
        self.finished = True
        delta, hit = self.stops.finish(self.text.flush())  # the last characters may complete a stop sequence
        if event.reason == "error":
            self.span.set_status(Status(StatusCode.ERROR, "failed inside the engine"))
            await self.abort(grpc.StatusCode.INTERNAL, "the request failed inside the engine; see server logs")
        if event.reason == "unavailable":
            self.span.set_status(Status(StatusCode.ERROR, "its replica's role is gone"))
            await self.abort(grpc.StatusCode.UNAVAILABLE, f"replica {self.scheduler.replica} lost a role process "
                             "mid-request; the request can be sent again")
        return self._message((), delta, total_ns, self._finish(event, "stop_sequence" if hit else event.reason))

    async def _stop(self, stream: Stream) -> FinishEvent:
        """End a request whose text hit a stop sequence. If it finished first (in the same step, or in a step the
        step thread ran before the cancel's turn), its FinishEvent is on the stream's queue."""
        final = await self.scheduler.cancel(stream.key)
        while final is None:
            event = stream.events.get_nowait()
            final = event if isinstance(event, FinishEvent) else None
        return final

    def _finish(self, event: FinishEvent, reason: str) -> api_pb2.Finish:
        """The finish message; the request's metrics and span attributes recorded."""
        completion_tokens = self.admission.sent
        if self.metrics is not None:
            self.metrics.requests_finished.labels(reason=reason).inc()
            self.metrics.request_latency.observe(time.perf_counter() - self.clock.started)
        attrs = {tracing.ATTR_FINISH_REASON: reason}
        if self.clock.ttft_s is not None:
            attrs[tracing.ATTR_TTFT_S] = self.clock.ttft_s
        st = event.stats
        attrs.update({tracing.ATTR_COMPLETION_TOKENS: completion_tokens, tracing.ATTR_DRAFTED: st.drafted,
                      tracing.ATTR_ACCEPTED: st.accepted, tracing.ATTR_TAU: st.tau})
        self.span.set_attributes(attrs)
        return finish_message(event, len(self.request.prompt_ids), completion_tokens, reason)
