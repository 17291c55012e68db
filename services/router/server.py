"""The public gRPC API (blockspec.v1.Generation): a Generate call is validated (messages.py), admitted (admission.py),
and streamed from the replica its version routes it to (prefix_routing.py, request_stream.py); ModelInfo and Tokenize
answer from the version's facts."""

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
from blockspec.common.wire.auth import DEFAULT_TENANT, ApiKeys
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.router.admission import Admission, Admissions, AlreadyRunning
from blockspec.services.router.limits import OverLimit, TenantLimits
from blockspec.services.router.messages import (
    OFF_LOOP_CHARS,
    ModelFacts,
    check_message,
    prompt_chars,
    to_request,
)
from blockspec.services.router.prefix_routing import PrefixRouter
from blockspec.services.router.request_stream import RequestStream
from blockspec.services.router.scheduler import Scheduler
from blockspec.services.router.step_loop import Request

log = logging.getLogger(__name__)


VERSION_HEADER = "blockspec-version"  # gRPC metadata (and HTTP's X-Blockspec-Version): the version that answered


@dataclass(eq=False)
class Version:
    """One serving version: a model pair and its settings, over its own replicas. New requests go to the service's
    active version; another one finishes its streams (blue/green rollouts, services/serving/rollout.py)."""

    facts: ModelFacts
    schedulers: list[Scheduler]  # replicas come and go with autoscaling (app.RouterServer)
    draining: set[Scheduler] = field(default_factory=set)  # replicas that take no new request (their streams finish)
    metrics: RouterMetrics | None = None  # the router's instruments at this version
    routing: PrefixRouter | None = field(default_factory=PrefixRouter)  # None: the least loaded replica, always

    @property
    def name(self) -> str:
        return self.facts.version

    @property
    def load(self) -> int:
        return sum(s.load for s in self.schedulers)

    def replica(self, prompt_ids: Sequence[int] = (), tenant: str = DEFAULT_TENANT) -> Scheduler:
        """Where a new request goes: among the replicas that take new requests (a draining or lost one only where no
        other is left), the one `routing` picks for the tenant's prompt, else the least loaded."""
        open_ = [s for s in self.schedulers if s not in self.draining and not s.lost] or self.schedulers
        if self.routing is not None:
            return self.routing.route(open_, prompt_ids, tenant)
        return min(open_, key=lambda s: s.load)


class GenerationService(api_grpc.GenerationServicer):
    def __init__(self, schedulers: Sequence[Scheduler] | Version, facts: ModelFacts | None = None,
                 metrics: RouterMetrics | None = None, api_keys: ApiKeys | None = None,
                 limits: TenantLimits | None = None) -> None:
        self.version = schedulers if isinstance(schedulers, Version) else Version(
            facts, list(schedulers), metrics=metrics.at(facts.version) if metrics is not None else None)
        self.versions = {self.version.name: self.version}  # every version that serves or finishes streams
        self.api_keys = api_keys  # the interceptor has checked the key; here it names the caller's tenant
        self.admissions = Admissions(limits)

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
        span = tracing.tracer().start_span(tracing.SPAN_REQUEST, attributes={tracing.ATTR_VERSION: version.name})

        async def abort(code: grpc.StatusCode, message: str, trailing_metadata: tuple = ()) -> None:
            span.set_status(Status(StatusCode.ERROR, message))
            await self._abort(context, code, message, trailing_metadata)

        try:
            await context.send_initial_metadata(((VERSION_HEADER, version.name),))
            request = await self._request(msg, version.facts, span, abort)
            with await self._admit(request, msg.HasField("max_tokens"), context, abort) as admission:
                if not version.schedulers:  # a version being stopped (a withdrawn rollout's, on its check socket)
                    admission.prompt_spent = False  # nothing ran: all it reserved comes back
                    await abort(grpc.StatusCode.UNAVAILABLE, f"version {version.name} has no replica serving; the "
                                "request can be sent again")
                replica = version.replica(request.prompt_ids, admission.tenant)
                stream = RequestStream(admission, replica, version.facts.tokenizer, list(msg.stop), span,
                                       version.metrics, abort)
                # Closed at once when the call ends, so its slots and tokens come back then, not at collection.
                async with contextlib.aclosing(stream.responses(started)) as responses:
                    async for response in responses:
                        yield response
        finally:
            span.end()

    async def _request(self, msg: api_pb2.GenerateRequest, facts: ModelFacts, span, abort) -> Request:
        """The validated request (else INVALID_ARGUMENT), its span's attributes set."""
        try:
            if prompt_chars(msg) > OFF_LOOP_CHARS:  # the tokenizer releases the GIL: other streams go on
                request = await asyncio.to_thread(to_request, msg, facts)
            else:
                request = to_request(msg, facts)
        except InvalidArgument as e:
            await abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request = replace(request, span_context=span.get_span_context())
        span.set_attributes({tracing.ATTR_REQUEST_ID: request.request_id, tracing.ATTR_K: request.k,
                             tracing.ATTR_PROMPT_TOKENS: len(request.prompt_ids)})
        return request

    async def _admit(self, request: Request, max_tokens_set: bool, context: grpc.aio.ServicerContext,
                     abort) -> Admission:
        """The request's admission (admission.py), or the call ends: ALREADY_EXISTS for a request_id in use,
        INVALID_ARGUMENT for more than a whole bucket, RESOURCE_EXHAUSTED with `retry-after` (seconds) where the
        tenant's buckets lack room now."""
        tenant = self._tenant(context)
        if self.api_keys is not None:  # a tenant's cached prefixes are its own: another cannot time them
            request = replace(request, cache_salt=tenant)
        try:
            return self.admissions.admit(request, tenant, max_tokens_set)
        except AlreadyRunning as e:
            await abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except InvalidArgument as e:
            unset = "" if max_tokens_set else (" (max_tokens was unset: as many as the limit allows, and the prompt's "
                                               f"{len(request.prompt_ids)} leave none)")
            await abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e}{unset}")
        except OverLimit as e:
            if self.metrics is not None:
                self.metrics.rate_limited.labels(tenant=tenant, limit=e.limit).inc()
            await abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                        trailing_metadata=(("retry-after", str(math.ceil(e.retry_after_s))),))

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        if self.api_keys is None:
            return DEFAULT_TENANT
        return self.api_keys.caller(context.invocation_metadata()) or DEFAULT_TENANT

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
