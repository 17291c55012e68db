"""The stream loop both role services run: one long-lived bidirectional stream per router, each op traced and
answered with the role's memory, and the requests a router held forgotten when its stream ends."""

from __future__ import annotations

import abc
import asyncio
import logging

import grpc

from blockspec.common.telemetry import tracing
from blockspec.common.telemetry.metrics import ROLE_MEMORY_MAX_AGE_S, process_memory

log = logging.getLogger(__name__)


class RoleStream(abc.ABC):
    """Base of a role's servicer. A subclass names its `role` and span, runs one op in `_run(request, session)`,
    drops one request's state in `_forget`, and may refuse ops with `_refusal`. Requests it takes from a stream
    are recorded in `_sessions` (request id -> the stream's session) so that they end with that stream."""

    role = ""
    span_name = ""

    def __init__(self) -> None:
        self._sessions: dict[str, object] = {}  # request -> the stream (router) that last sent it

    @property
    def held(self) -> int:
        """Requests a router sent and has not released (their state is kept for the next op)."""
        return len(self._sessions)

    @abc.abstractmethod
    def _run(self, request, session: object):
        """One op of the stream; returns its response message."""

    @abc.abstractmethod
    def _forget(self, request_id: str) -> None:
        """Drop what the role holds for a request."""

    def _items(self, request) -> int:
        """How many request items an op carries (a span attribute)."""
        return 0

    def _refusal(self) -> str | None:
        """Why no op can run now (the stream is aborted with FAILED_PRECONDITION and this message); None: they can."""
        return None

    async def Steps(self, requests, context):
        # Each op runs on the server's own thread, one at a time: handing it to a worker thread and back costs a
        # thread wake-up each way on every op, which is much of a small step.
        session = object()  # the router on this stream: what it sent and did not release ends with it
        try:
            async for req in requests:
                refusal = self._refusal()
                if refusal is not None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
                yield self._handle(req, session)
        except asyncio.CancelledError:  # the router went away or the server is stopping: not an error
            return
        finally:
            self._end_session(session)

    def _end_session(self, session: object) -> None:
        """A router's stream has ended (it stopped, reconnected after a timeout, or died): forget what it still
        held, so a router started again finds the slots free. A request sent again on a new stream belongs to
        that one and is not forgotten here."""
        held = [rid for rid, owner in self._sessions.items() if owner is session]
        for rid in held:
            self._forget(rid)
            self._sessions.pop(rid, None)
        if held:
            log.warning("%s: a router's stream ended holding %d requests: forgotten", self.role, len(held))

    def _handle(self, req, session: object = None):
        attributes = {tracing.ATTR_ROLE: self.role, tracing.ATTR_ITEMS: self._items(req)}
        with tracing.tracer().start_as_current_span(self.span_name, context=tracing.remote_parent(req.traceparent),
                                                    attributes=attributes):
            resp = self._run(req, session)
        resp.rss_bytes, resp.gpu_bytes = process_memory(ROLE_MEMORY_MAX_AGE_S)
        return resp
