"""OpenTelemetry tracing in one place: span and attribute names, exporter setup from the standard
OTEL_* variables, and the traceparent carried in role messages (one stream, many steps).

Model code never imports this; the router's servicer and step loop and the role servicers do. Where OpenTelemetry is
not installed (the GPU machines' image, which runs `gpu-check`'s step loops) nothing records and the step loop makes
no span; the servers need it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

try:
    from opentelemetry import context, trace
    from opentelemetry.trace import Link, Span, SpanContext
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:
    trace = None

log = logging.getLogger(__name__)

TRACER = "blockspec"

# Span names.
SPAN_REQUEST = "blockspec.request"  # router: one per Generate call, arrival to last message
SPAN_STEP = "blockspec.step"  # router: one per speculative step (propose -> verify -> commit)
SPAN_VERIFIER_OP = "blockspec.verifier.op"  # verifier role: one per prefill / verify message
SPAN_DRAFTER_OP = "blockspec.drafter.propose"  # drafter role: one per propose message

# Attribute names.
ATTR_REQUEST_ID = "blockspec.request_id"
ATTR_VERSION = "blockspec.version"  # the serving version (model.version) that answered the request
ATTR_PROMPT_TOKENS = "blockspec.prompt_tokens"
ATTR_COMPLETION_TOKENS = "blockspec.completion_tokens"
ATTR_FINISH_REASON = "blockspec.finish_reason"
ATTR_TTFT_S = "blockspec.time_to_first_token_s"
ATTR_K = "blockspec.k"  # the largest k of the step (the drafter's, or a longer lookup's)
ATTR_DRAFTED = "blockspec.drafted"  # draft tokens verified
ATTR_ACCEPTED = "blockspec.accepted"
ATTR_TAU = "blockspec.tau"  # tokens committed per request in the step (request span: over the request)
ATTR_BATCH_SIZE = "blockspec.batch_size"
ATTR_DRAFT_S = "blockspec.draft_s"
ATTR_VERIFY_S = "blockspec.verify_s"
ATTR_FALLBACK = "blockspec.drafter_fallback"  # the drafter failed: the step ran at k = 0
ATTR_LOOKED_UP = "blockspec.looked_up"  # requests drafted by prompt lookup instead of the drafter
ATTR_ROLE = "blockspec.role"
ATTR_ITEMS = "blockspec.items"  # requests in a role message

_propagator = TraceContextTextMapPropagator() if trace is not None else None
_configured = False


def setup_tracing(service_name: str) -> None:
    """Export spans over OTLP when OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set (the exporter reads the
    other standard OTEL_* variables itself); otherwise spans are no-ops. Once per process."""
    global _configured
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if _configured or not endpoint or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True
    log.info("tracing: exporting spans of %s to %s", service_name, endpoint)


def shutdown_tracing() -> None:
    """Flush and stop the exporter (on the way out)."""
    if trace is None:
        return
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer() -> "trace.Tracer":
    return trace.get_tracer(TRACER)


def traceparent() -> str:
    """The current span as a W3C traceparent ('' when no span is recording)."""
    if trace is None:
        return ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", "")


def remote_parent(value: str) -> context.Context:
    """A context whose parent is the span named by a traceparent ('' -> a new trace)."""
    return _propagator.extract({"traceparent": value}) if value else context.Context()


def recording() -> bool:
    """Whether spans go anywhere: a tracer provider has been set (setup_tracing, or a test's own). Until then
    every span is a no-op, and the step loop makes none (right after a target forward, with its caches
    cold, even a no-op step span and its context cost a measurable share of a step)."""
    return trace is not None and not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def step_span(parents: Sequence[SpanContext | None]) -> Span:
    """A step span: a child of the first request's span (one trace per request at concurrency 1),
    linked to the spans of every request the step served."""
    parents = [p for p in parents if p is not None and p.is_valid]
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(parents[0])) if parents else context.Context()
    return tracer().start_span(SPAN_STEP, context=ctx, links=[Link(p) for p in parents])


def use_span(span: Span):
    """The step's span as the current one until the block ends, then ended."""
    return trace.use_span(span, end_on_exit=True)


def set_step_attributes(span: Span, report) -> None:
    """A finished step's figures (router/step_loop.StepReport) on its span."""
    span.set_attributes({
        ATTR_K: report.k, ATTR_DRAFTED: report.draft_tokens, ATTR_ACCEPTED: report.accepted_tokens,
        ATTR_BATCH_SIZE: report.batch_size, ATTR_TAU: 1 + report.accepted_tokens / report.batch_size,
        ATTR_DRAFT_S: report.draft_s, ATTR_VERIFY_S: report.verify_s, ATTR_FALLBACK: report.fallback,
        ATTR_LOOKED_UP: report.looked_up})
