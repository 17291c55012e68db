"""The public gRPC API (blockspec.v1.Generation): unpack -> validate -> schedule -> stream back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc
from opentelemetry.trace import Status, StatusCode

from blockspec.common.errors import InvalidArgument
from blockspec.common.telemetry import tracing
from blockspec.common.telemetry.metrics import RouterMetrics
from blockspec.common.tokens.detokenize import TextStream
from blockspec.common.wire.auth import DEFAULT_TENANT, ApiKeys
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.router.limits import OverLimit, TenantLimits
from blockspec.services.router.messages import (
    OFF_LOOP_CHARS,
    ModelFacts,
    check_message,
    finish_message,
    prompt_chars,
    to_request,
)
from blockspec.services.router.scheduler import Scheduler, Stream
from blockspec.services.router.step_loop import FinishEvent, Request
from blockspec.services.router.stops import StopMatcher

log = logging.getLogger(__name__)


class _StreamClock:
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


VERSION_HEADER = "blockspec-version"  # gRPC metadata (and HTTP's X-Blockspec-Version): the version that answered


@dataclass(eq=False)
class Version:
    """One serving version: a model pair and its settings, over its own replicas. New requests go to the service's
    active version; another one finishes its streams (blue/green rollouts, services/serving/rollout.py)."""

    facts: ModelFacts
    schedulers: list[Scheduler]  # replicas come and go with autoscaling (app.RouterServer)
    draining: set[Scheduler] = field(default_factory=set)  # replicas that take no new request (their streams finish)
    metrics: RouterMetrics | None = None  # the router's instruments at this version

    @property
    def name(self) -> str:
        return self.facts.version

    @property
    def load(self) -> int:
        return sum(s.load for s in self.schedulers)


class GenerationService(api_grpc.GenerationServicer):
    def __init__(self, schedulers: Sequence[Scheduler] | Version, facts: ModelFacts | None = None,
                 metrics: RouterMetrics | None = None, api_keys: ApiKeys | None = None,
                 limits: TenantLimits | None = None) -> None:
        self.version = schedulers if isinstance(schedulers, Version) else Version(
            facts, list(schedulers), metrics=metrics.at(facts.version) if metrics is not None else None)
        self.versions = {self.version.name: self.version}  # every version that serves or finishes streams
        self.api_keys = api_keys  # the interceptor has checked the key; here it names the caller's tenant
        self.limits = limits if limits is not None and limits.enabled else None
        # request_ids of live streams, across replicas (each scheduler knows only its own)
        self._live: dict[str, Request] = {}

    # The active version's: where new requests go.
    schedulers = property(lambda self: self.version.schedulers)
    draining = property(lambda self: self.version.draining)
    facts = property(lambda self: self.version.facts)
    metrics = property(lambda self: self.version.metrics)

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                     trailing_metadata: tuple = ()) -> None:
        if self.metrics is not None:
            self.metrics.request_errors.labels(code=code.name).inc()
        await context.abort(code, message, trailing_metadata=trailing_metadata)

    async def Generate(self, msg: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        started = time.perf_counter_ns()
        version = self.version  # the request's, from arrival to its last token
        clock = _StreamClock(version.metrics)
        span = tracing.tracer().start_span(tracing.SPAN_REQUEST, attributes={tracing.ATTR_VERSION: version.name})
        try:
            await context.send_initial_metadata(((VERSION_HEADER, version.name),))
            request, tenant = await self._request(msg, context, span, version.facts)
            try:
                # Closed at once when the call ends, so its slots and tokens come back then, not at collection.
                async with contextlib.aclosing(self._stream(request, tenant, msg, context, span, clock, started,
                                                            version)) as responses:
                    async for response in responses:
                        yield response
            finally:
                self._free(request)
        finally:
            span.end()

    async def _request(self, msg, context, span, facts: ModelFacts) -> tuple[Request, str]:
        """The validated request and its caller's tenant, once the tenant's rate limits admit it (else aborted)."""
        try:
            if prompt_chars(msg) > OFF_LOOP_CHARS:  # the tokenizer releases the GIL: other streams go on
                request = await asyncio.to_thread(to_request, msg, facts)
            else:
                request = to_request(msg, facts)
        except InvalidArgument as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request = replace(request, span_context=span.get_span_context())
        span.set_attributes({tracing.ATTR_REQUEST_ID: request.request_id, tracing.ATTR_K: request.k,
                             tracing.ATTR_PROMPT_TOKENS: len(request.prompt_ids)})
        if request.request_id in self._live:  # before admission: a refused duplicate takes no budget
            span.set_status(Status(StatusCode.ERROR, "request_id in use"))
            await self._abort(context, grpc.StatusCode.ALREADY_EXISTS,
                              f"request_id: {request.request_id!r} is already running")
        self._live[request.request_id] = request
        try:
            admitted, tenant = await self._admit(request, context, span, msg.HasField("max_tokens"))
        except BaseException:  # refused by its rate limit: the id is free again
            self._free(request)
            raise
        self._live[request.request_id] = admitted  # its max_tokens may be the tenant's most
        return admitted, tenant

    def _free(self, request: Request) -> None:
        """Its request_id is free again, unless a later stream took it already (the id was freed when this stream
        began to end, and a client may resend under it before that ends)."""
        if self._live.get(request.request_id) is request:
            del self._live[request.request_id]

    def _refund(self, tenant: str, tokens: int) -> None:
        """Tokens a request reserved and did not generate go back to its tenant's budget."""
        if self.limits is not None:
            self.limits.refund(tenant, tokens)

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        if self.api_keys is None:
            return DEFAULT_TENANT
        return self.api_keys.caller(context.invocation_metadata()) or DEFAULT_TENANT

    async def _admit(self, request: Request, context: grpc.aio.ServicerContext, span,
                     max_tokens_set: bool) -> tuple[Request, str]:
        """The request and its caller's tenant, once the tenant's rate limits admit it (reserving prompt + max_tokens;
        an unset max_tokens, the rest of the context, is cut to what the tenant's token buckets hold now); else
        INVALID_ARGUMENT (more than a whole bucket holds) or RESOURCE_EXHAUSTED with `retry-after` (seconds)."""
        if self.limits is None:
            return request, DEFAULT_TENANT
        tenant, prompt = self._tenant(context), len(request.prompt_ids)
        try:
            if max_tokens_set:
                self.limits.admit(tenant, prompt + request.max_tokens)
            else:  # as many as the tenant's token buckets hold now
                request = replace(request, max_tokens=self.limits.admit_up_to(tenant, prompt, request.max_tokens))
        except InvalidArgument as e:
            unset = "" if max_tokens_set else f" (max_tokens was unset: as many as the limit allows, and the prompt's {prompt} leave none)"
            span.set_status(Status(StatusCode.ERROR, str(e)))
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{e}{unset}")
        except OverLimit as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            if self.metrics is not None:
                self.metrics.rate_limited.labels(tenant=tenant, limit=e.limit).inc()
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                              trailing_metadata=(("retry-after", str(math.ceil(e.retry_after_s))),))
        return request, tenant

    async def _stream(self, request: Request, tenant: str, msg, context, span, clock: _StreamClock, started: int,
                      version: Version):
        """Submit to the version's least loaded replica and stream its events back."""
        if not version.schedulers:  # a version being stopped (a withdrawn rollout's, asked on its check socket)
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, f"version {version.name} has no replica serving; "
                              "the request can be sent again")
        open_ = [s for s in version.schedulers if s not in version.draining and not s.lost] or version.schedulers
        scheduler = min(open_, key=lambda s: s.load)  # balance replicas by queue length
        stream = await self._submit(scheduler, request, tenant, context)
        metrics = version.metrics
        if metrics is not None:
            metrics.prompt_tokens.inc(len(request.prompt_ids))
        text, stops = TextStream(version.facts.tokenizer), StopMatcher(list(msg.stop))
        rid, finished, sent = request.request_id, False, 0  # sent: token ids the stream has carried
        try:
            while True:
                event = await stream.events.get()
                total_ns = time.perf_counter_ns() - started
                if not isinstance(event, FinishEvent):
                    delta, hit = stops.push(text.push(event.token_ids))
                    clock.sent(len(event.token_ids))
                    sent += len(event.token_ids)
                    if not hit:
                        yield api_pb2.GenerateResponse(request_id=rid, token_ids=event.token_ids, text=delta, total_ns=total_ns)
                        continue
                    finished = True
                    final = await self._stop(scheduler, stream)
                    self._finished(span, clock, final, sent, "stop_sequence", metrics)
                    yield api_pb2.GenerateResponse(request_id=rid, token_ids=event.token_ids, text=delta, total_ns=total_ns,
                                                   finish=finish_message(final, len(request.prompt_ids), sent, "stop_sequence"))
                    return
                finished = True
                delta, hit = stops.finish(text.flush())  # the last characters may complete a stop sequence
                if event.reason == "error":
                    span.set_status(Status(StatusCode.ERROR, "failed inside the engine"))
                    await self._abort(context, grpc.StatusCode.INTERNAL, "the request failed inside the engine; see server logs")
                if event.reason == "unavailable":
                    span.set_status(Status(StatusCode.ERROR, "its replica's role is gone"))
                    await self._abort(context, grpc.StatusCode.UNAVAILABLE, f"replica {scheduler.replica} lost a role "
                                      "process mid-request; the request can be sent again")
                reason = "stop_sequence" if hit else event.reason
                self._finished(span, clock, event, sent, reason, metrics)
                yield api_pb2.GenerateResponse(request_id=rid, text=delta, total_ns=total_ns,
                                               finish=finish_message(event, len(request.prompt_ids), sent, reason))
                return
        finally:
            self._free(request)  # at once, as the scheduler frees it: a client may resend under it now
            self._refund(tenant, request.max_tokens - sent)  # first: the cancel below may be cancelled itself
            if not finished:  # client cancelled or deadline exceeded: free the slots in both roles
                span.set_attribute(tracing.ATTR_FINISH_REASON, "cancelled")
                if metrics is not None:
                    metrics.requests_finished.labels(reason="cancelled").inc()
                await asyncio.shield(scheduler.cancel(stream.key))

    async def _submit(self, scheduler: Scheduler, request: Request, tenant: str, context) -> Stream:
        """The request's stream; what it reserved comes back if it never starts."""
        try:
            return await scheduler.submit(request)
        except ValueError as e:  # nothing was served: the prompt's tokens come back too
            self._refund(tenant, len(request.prompt_ids) + request.max_tokens)
            await self._abort(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id: {e}")
        except asyncio.CancelledError:  # gone while the submit waited: cancelled at once, as a stream that sent nothing
            self._refund(tenant, request.max_tokens)
            raise

    @staticmethod
    async def _stop(scheduler: Scheduler, stream: Stream) -> FinishEvent:
        """End a request whose text hit a stop sequence. If it finished first (in the same step, or in a step the
        step thread ran before the cancel's turn), its FinishEvent is on the stream's queue."""
        final = await scheduler.cancel(stream.key)
        while final is None:
            event = stream.events.get_nowait()
            final = event if isinstance(event, FinishEvent) else None
        return final

    @staticmethod
    def _finished(span, clock: _StreamClock, event: FinishEvent, completion_tokens: int, reason: str,
                  metrics: RouterMetrics | None) -> None:
        if metrics is not None:
            metrics.requests_finished.labels(reason=reason).inc()
            metrics.request_latency.observe(time.perf_counter() - clock.started)
        attrs = {tracing.ATTR_FINISH_REASON: reason}
        if clock.ttft_s is not None:
            attrs[tracing.ATTR_TTFT_S] = clock.ttft_s
        st = event.stats
        attrs.update({tracing.ATTR_COMPLETION_TOKENS: completion_tokens, tracing.ATTR_DRAFTED: st.drafted,
                      tracing.ATTR_ACCEPTED: st.accepted, tracing.ATTR_TAU: st.tau})
        span.set_attributes(attrs)

    @staticmethod
    async def _check(msg: object, context: grpc.aio.ServicerContext) -> None:
        try:
            check_message(msg)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def ModelInfo(self, msg: api_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext) -> api_pb2.ModelInfoResponse:
        await self._check(msg, context)
        f = self.facts
        await context.send_initial_metadata(((VERSION_HEADER, f.version),))
        return api_pb2.ModelInfoResponse(target=f.target, drafter=f.drafter, method=f.method,
                                         max_speculative_tokens=f.max_k, context_len=f.context_len, vocab_size=f.vocab_size,
                                         default_speculative_tokens=f.default_k if f.max_k else 0, version=f.version)

    async def Tokenize(self, msg: api_pb2.TokenizeRequest, context: grpc.aio.ServicerContext) -> api_pb2.TokenizeResponse:
        await self._check(msg, context)
        facts = self.facts
        await context.send_initial_metadata(((VERSION_HEADER, facts.version),))
        try:
            facts.check_text("text", len(msg.text))
        except InvalidArgument as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        encode = facts.tokenizer.encode
        if len(msg.text) > OFF_LOOP_CHARS:
            return api_pb2.TokenizeResponse(token_ids=await asyncio.to_thread(encode, msg.text))
        return api_pb2.TokenizeResponse(token_ids=encode(msg.text) if msg.text else [])
