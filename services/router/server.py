"""The public gRPC API (blockspec.v1.Generation): unpack -> validate -> schedule -> stream back."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc
import jinja2
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from opentelemetry.trace import Status, StatusCode

from blockspec.common import tracing
from blockspec.common.auth import DEFAULT_TENANT, ApiKeys
from blockspec.common.detokenize import TextStream
from blockspec.common.errors import InvalidArgument
from blockspec.common.sampling import from_pb, validate
from blockspec.common.telemetry import DEFAULT_VERSION, RouterMetrics
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.router.limits import OverLimit, TenantLimits
from blockspec.services.router.scheduler import Scheduler, Stream
from blockspec.services.router.step_loop import FinishEvent, Request
from blockspec.services.router.stops import StopMatcher
from blockspec.services.router.validation import validate_request, validate_stops

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What the router knows of the models: for validation, tokenization and ModelInfo."""

    target: str
    drafter: str
    method: str
    max_k: int
    default_k: int
    context_len: int
    vocab_size: int
    tokenizer: object
    version: str = DEFAULT_VERSION  # the serving version's name: on every response, metric and trace

    @functools.cached_property
    def max_text_chars(self) -> int:
        """Characters past which a text cannot fit the context whatever it holds (a token's text is at most its
        longest vocabulary entry's): a longer one is refused before it is tokenized on the event loop."""
        return self.context_len * max(map(len, self.tokenizer.get_vocab()))

    def check_text(self, field: str, chars: int) -> None:
        if chars > self.max_text_chars:
            raise InvalidArgument(field, f"{chars} characters cannot fit the context of {self.context_len} tokens")


def check_message(msg: object) -> None:
    """A request that did not parse, or that carries fields this server does not know (at any depth: a newer
    client's sampling option is refused, not ignored), is refused."""
    if isinstance(msg, DecodeError):
        raise InvalidArgument("request", f"does not parse as {api_pb2.DESCRIPTOR.package} message ({msg}); "
                              "string fields must be valid UTF-8")
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        raise InvalidArgument("request", f"unknown field number(s) {numbers} for {msg.DESCRIPTOR.full_name}")
    for descriptor, value in msg.ListFields():
        if descriptor.message_type is not None and not descriptor.message_type.GetOptions().map_entry:
            for item in value if descriptor.is_repeated else [value]:
                check_message(item)


MAX_REQUEST_ID_CHARS = 256
# Prompts of more characters are tokenized on a worker thread: the largest the context allows (about 400,000
# characters for the default pair) takes a good part of a second, during which the event loop would send no other
# stream's tokens. Shorter ones stay on the loop, where tokenizing costs less than the hop to a thread.
OFF_LOOP_CHARS = 8192


def prompt_chars(msg: api_pb2.GenerateRequest | Exception) -> int:
    """The characters the prompt gives the tokenizer, chat roles included (0: token ids, or a message that did not
    parse): what check_text bounds and what decides where it is tokenized."""
    which = msg.WhichOneof("prompt") if isinstance(msg, api_pb2.GenerateRequest) else None
    if which == "text":
        return len(msg.text)
    return sum(len(m.content) + len(m.role) for m in msg.chat.messages) if which == "chat" else 0


def to_request(msg: api_pb2.GenerateRequest, facts: ModelFacts) -> Request:
    """Validate a GenerateRequest (errors name the field) and turn it into a step-loop Request."""
    check_message(msg)
    which = msg.WhichOneof("prompt")
    if which is None:
        raise InvalidArgument("prompt", "set prompt.text, prompt.token_ids or prompt.chat")
    if len(msg.request_id) > MAX_REQUEST_ID_CHARS:  # it comes back in every message of the stream
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(msg.request_id)}")
    if which == "text":
        facts.check_text("prompt", prompt_chars(msg))
        ids = facts.tokenizer.encode(msg.text) if msg.text else []
    elif which == "chat":
        facts.check_text("chat.messages", prompt_chars(msg))
        ids = chat_ids(msg.chat, facts.tokenizer)
    else:
        ids = list(msg.token_ids.ids)
        bad = [t for t in ids if t >= facts.vocab_size]
        if bad:
            raise InvalidArgument("token_ids", f"id {bad[0]} is outside the vocabulary of {facts.vocab_size}")
    sampling = validate(from_pb(msg.sampling), facts.vocab_size)
    validate_stops(msg.stop)
    k = msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else (facts.default_k if facts.max_k else 0)
    # Unset: the rest of the context (as vLLM's); a prompt that fills it is refused below, naming the prompt.
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else max(1, facts.context_len - len(ids))
    validate_request(ids, max_tokens, k, context_len=facts.context_len, max_k=facts.max_k,
                     k_field="num_speculative_tokens")
    return Request(msg.request_id or uuid.uuid4().hex, tuple(ids), max_tokens, k, sampling)


# apply_chat_template's own arguments: a template variable of one of these names would change how it renders.
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
                                "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                "tokenizer_kwargs"})


def chat_ids(chat: api_pb2.Chat, tokenizer) -> list[int]:
    """A conversation's prompt: the target's chat template over its messages (and `template_kwargs`, the variables a
    template reads such as Qwen's `enable_thinking`), the assistant's turn opened."""
    if not chat.messages:
        raise InvalidArgument("chat.messages", "must not be empty")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("chat", "the target's tokenizer has no chat template (`chat_template` in its "
                                      "tokenizer_config.json): send prompt.text or prompt.token_ids")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidArgument(f"chat.messages[{i}].role", "must not be empty")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    kwargs = json_format.MessageToDict(chat.template_kwargs) if chat.HasField("template_kwargs") else {}
    reserved = sorted(set(kwargs) & TEMPLATE_ARGUMENTS)
    if reserved:
        raise InvalidArgument(f"chat.template_kwargs.{reserved[0]}", "is set by the server, not a template variable")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except jinja2.TemplateError as e:  # the template's own checks (roles that must alternate, ...)
        raise InvalidArgument("chat.messages", f"the chat template refused them: {e}") from None
    except Exception as e:  # noqa: BLE001 - a template is code: what it raises over these messages is about them
        raise InvalidArgument("chat.messages", f"the chat template failed on them: {type(e).__name__}: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens


def finish_message(event: FinishEvent, prompt_tokens: int, completion_tokens: int, reason: str) -> api_pb2.Finish:
    """completion_tokens: the token ids the stream sent (a stop sequence ends it before what the engine
    committed after it)."""
    st = event.stats
    return api_pb2.Finish(
        reason=reason,
        usage=api_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
        acceptance=api_pb2.AcceptanceSummary(
            steps=st.steps, drafted=st.drafted, accepted=st.accepted, tau=st.tau,
            acceptance_rate=st.acceptance_rate or 0.0, accepted_per_pos=st.accepted_per_pos,
        ),
    )


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
