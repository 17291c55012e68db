"""The HTTP side of the router on uvicorn (ASGI, Starlette): GET /health (readiness), GET /metrics (Prometheus) and
the OpenAI-compatible /v1 paths (openai_http.py).

What the server bounds for every connection: the listen backlog (BACKLOG), the time to send a request's head
(HEAD_TIMEOUT_S: a client that trickles header bytes is cut off), a head's size (MAX_HEAD_BYTES: 431 and the
connection closed), the time and size of a body (openai_http.py). With `tls`, the TLS handshake is this module's (asyncio's start_tls), so a refused
handshake is counted and logged with its peer."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import httptools
import uvicorn
from prometheus_client import REGISTRY
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from blockspec.common.wire.auth import CHALLENGE, DENIED, OPEN_HTTP_PATHS, ApiKeys
from blockspec.common.wire.grpc_server import BindError
from blockspec.services.router.openai_api import ApiError
from blockspec.services.router.openai_http import V1App, error_response, header

log = logging.getLogger(__name__)

BACKLOG = 2048  # connections the kernel queues before accept (as uvicorn's and nginx's default; capped by somaxconn)
HEAD_TIMEOUT_S = 10.0  # a connection that has not sent a whole request head (and TLS handshake) in this long is closed
HEALTH_MAX_AGE_S = 0.5  # /health answers from a readiness at most this old (asked of the roles in one thread)
# A request head (request line and headers) past this is refused with 431 and its connection closed, before more of
# it is held: nginx's default bound (4 buffers of 8 KiB); llhttp itself has none.
MAX_HEAD_BYTES = 32 << 10
LINGER_S = 1.0  # after a refused head, what the client still sends is read and dropped this long before the close


class HeadTooLarge(Exception):
    """Raised inside the parser's callback to stop parsing a head past MAX_HEAD_BYTES."""


class Ready(NamedTuple):
    """What /health says: serving (200) or not (503); degraded: serving without something (the drafter: k = 0)."""

    serving: bool
    detail: str
    degraded: bool = False


class HealthCache:
    """The readiness, asked at most once per HEALTH_MAX_AGE_S in a worker thread (it asks the roles over gRPC):
    any number of simultaneous probes wait on one question, and the event loop never waits on a role."""

    def __init__(self, readiness: Callable[[], Ready]) -> None:
        self._readiness = readiness
        self._value: Ready | None = None
        self._at = 0.0
        self._pending: asyncio.Future | None = None

    async def get(self) -> Ready:
        if self._value is not None and time.monotonic() - self._at < HEALTH_MAX_AGE_S:
            return self._value
        if self._pending is None:
            self._pending = asyncio.ensure_future(asyncio.to_thread(self._readiness))
            self._pending.add_done_callback(self._store)
        return await asyncio.shield(self._pending)

    def _store(self, done: asyncio.Future) -> None:
        self._pending = None
        if not done.cancelled() and done.exception() is None:
            self._value, self._at = done.result(), time.monotonic()


def http_app(readiness: Callable[[], Ready], v1: V1App | None = None, api_keys: ApiKeys | None = None) -> Starlette:
    """The ASGI app of every path; v1: the app of the /v1/ paths (None: not served). With api_keys, every path but
    /health needs one of them (the /v1/ paths refuse as OpenAI's clients read it)."""
    health = HealthCache(readiness)

    async def health_route(request: Request) -> Response:
        ready = await health.get()
        return PlainTextResponse(ready.detail, 200 if ready.serving else 503)

    async def not_found(request: Request) -> Response:
        return PlainTextResponse("not found: GET /health, /metrics, /v1/models or POST /v1/completions, "
                                 "/v1/chat/completions\n", 404)

    async def metrics(request: Request) -> Response:
        encode, content_type = choose_encoder(request.headers.get("accept"))  # text or OpenMetrics, as asked
        return Response(encode(REGISTRY), headers={"Content-Type": content_type})

    routes = [Route("/health", health_route), Route("/metrics", metrics)]
    if v1 is not None:
        routes.append(Route("/v1/{rest:path}", v1))
    app = Starlette(routes=[*routes, Route("/{rest:path}", not_found, methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])])
    return app if api_keys is None else _Guard(app, api_keys)


class _Guard:
    """The keys in front of the app: OPEN_HTTP_PATHS as they are, every other path answered 401 without a known key
    (the /v1/ paths as an OpenAI error object). An Authorization header that is not printable ASCII is a 400."""

    def __init__(self, app, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_HTTP_PATHS:
            return await self.app(scope, receive, send)
        request = Request(scope)
        try:
            known = self.keys.tenant(header(request, "Authorization"))
        except ApiError as e:
            return await error_response(e)(scope, receive, send)
        if known is not None:
            return await self.app(scope, receive, send)
        if path.startswith("/v1/"):
            denied = error_response(ApiError("401 Unauthorized", "authentication_error", DENIED, headers=(CHALLENGE,)))
        else:
            denied = PlainTextResponse(f"{DENIED}\n", 401, headers=dict([CHALLENGE]))
        await denied(scope, receive, send)


class FrontProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol on httptools (llhttp's parser: h11's takes about twice as long a request) with a
    deadline for each request head (the first, and each one after a kept-alive answer) and, where `tls` is set, the
    TLS handshake done here so that a refusal is counted and logged."""

    tls = None  # a common.tls.ServerTls (set on a subclass per server)
    head_timeout_s = HEAD_TIMEOUT_S
    max_head_bytes = MAX_HEAD_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._made, self._head_timer, self._early = False, None, []
        self._head_bytes: int | None = 0  # bytes of the head being received; None once it is whole
        if self.tls is None:
            self._made = True
            super().connection_made(transport)
            self._arm_head_deadline()
            return
        transport.pause_reading()  # start_tls reads the client's hello
        self._handshake = asyncio.get_running_loop().create_task(self._start_tls(transport))

    async def _start_tls(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        try:
            tls_transport = await asyncio.get_running_loop().start_tls(
                transport, self, self.tls.context(), server_side=True, ssl_handshake_timeout=self.head_timeout_s)
        except (ssl.SSLEOFError, ConnectionError) as e:  # gone before a handshake (a TCP probe): not a refusal
            log.debug("HTTPS: %s closed the connection before its handshake (%s)", peer, e)
            transport.abort()
            return
        except (ssl.SSLError, TimeoutError, OSError) as e:
            self.tls.refused("HTTP", peer, e)
            transport.abort()
            return
        self._made = True
        super().connection_made(tls_transport)
        self._arm_head_deadline()
        for data in self._early:
            super().data_received(data)
        self._early.clear()

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with the head's size bounded: a chunk that is all head counts whole (a head that ends within a
        chunk is measured when it is whole, `on_headers_complete`)."""
        if not self._made:  # the request that came with the handshake's end, before start_tls returned here
            self._early.append(data)
            return
        if self._head_bytes == -1:  # refused: dropped while the answer reaches the client
            return
        in_head = self._head_bytes is not None
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, HeadTooLarge):
                return self._refuse_head()
            self._bad_request()
            return
        except httptools.HttpParserError:
            self._bad_request()
            return
        except httptools.HttpParserUpgrade:  # no WebSocket here (ws="none"): the request is answered as HTTP
            self._unsupported_upgrade_warning()
        if in_head and self._head_bytes is not None and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse_head()

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.max_head_bytes:
            raise HeadTooLarge
        self._head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes = 0  # the next request's head begins

    def _bad_request(self) -> None:
        log.debug("HTTP: %s sent a request that is not HTTP/1.1", self.client)
        self.send_400_response("Invalid HTTP request received.")

    def _refuse_head(self) -> None:
        """431, then the connection closed: the head is neither parsed further nor kept. Closing a socket with unread
        bytes resets it, which can destroy the answer in flight, so the write side is shut first and what the client
        still sends is dropped for LINGER_S (nginx's lingering close); over TLS it closes at once."""
        log.info("HTTP: refused a request head over %d bytes from %s", self.max_head_bytes, self.client)
        self._head_bytes, self.headers, self.url = -1, [], b""
        body = f"request head over {self.max_head_bytes} bytes (the request line and headers)\n".encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8"
                             b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        if self.tls is not None or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        if self._made:
            super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        waiting_on = self.cycle
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_deadline, waiting_on)

    def _head_deadline(self, waiting_on) -> None:
        """No new request head since the deadline was armed (the cycle is the same, its answer sent): close."""
        idle = self.cycle is waiting_on and (self.cycle is None or self.cycle.response_complete)
        if idle and not self.transport.is_closing():
            log.debug("HTTP: closing %s: no whole request head in %.0f s", self.client, self.head_timeout_s)
            self.transport.close()


class HttpServer:
    """uvicorn serving an app on a bound socket, in a daemon thread with its own event loop."""

    def __init__(self, app, sock: socket.socket, tls=None, head_timeout_s: float = HEAD_TIMEOUT_S) -> None:
        protocol = type("Front", (FrontProtocol,), {"tls": tls, "head_timeout_s": head_timeout_s})
        self.config = uvicorn.Config(app, http=protocol, lifespan="off", log_config=None, access_log=False,
                                     backlog=BACKLOG, timeout_graceful_shutdown=1, ws="none")
        self.server = uvicorn.Server(self.config)
        self.server.install_signal_handlers = lambda: None  # the process's own handlers stay (serve's SIGTERM)
        self.socket, self.server_port = sock, sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start")

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.socket]))

    def shutdown(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.socket.close()


def start_http(host: str, port: int, readiness: Callable[[], Ready], api_keys: ApiKeys | None = None,
               v1: V1App | None = None, tls=None, head_timeout_s: float = HEAD_TIMEOUT_S) -> HttpServer:
    """Serve in a daemon thread; returns the server (server.server_port is the bound port). With api_keys, every
    path but /health needs one of them. v1: the app of the /v1/ paths. tls: a common.tls.ServerTls (HTTPS)."""
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=BACKLOG)
    except OSError as e:
        raise BindError(f"cannot bind {host}:{port} for HTTP ({e.strerror or e})") from None
    return HttpServer(http_app(readiness, v1, api_keys), sock, tls, head_timeout_s)
