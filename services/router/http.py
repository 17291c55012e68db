"""The HTTP side of the router: GET /health (readiness: 200 or 503), GET /metrics (Prometheus) and the
OpenAI-compatible /v1 paths (openai_http.py)."""

from __future__ import annotations

import logging
import socketserver
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from blockspec.common.auth import ApiKeys, deny_plain, guard_wsgi
from blockspec.common.grpc_server import BindError
from blockspec.services.router.openai_http import CONNECTION, V1App

log = logging.getLogger(__name__)


HANDLER_TIMEOUT_S = 10.0  # a connection that sends no complete request in this long is closed


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per connection: an idle or slow client (a stuck scraper) cannot hold up a readiness probe."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A connection that timed out or broke: logged at debug level, not a traceback on stderr."""
        log.debug("HTTP connection from %s ended with an error", client_address, exc_info=True)


class _QuietHandler(WSGIRequestHandler):
    timeout = HANDLER_TIMEOUT_S

    def get_environ(self) -> dict:
        """The WSGI environ, with the client's socket: a long answer can tell that its client went away."""
        return {**super().get_environ(), CONNECTION: self.connection}

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        log.debug(format, *args)


def http_app(readiness: Callable[[], tuple[bool, str]], v1: V1App | None = None):
    """The WSGI app of every path; v1: the app of the /v1/ paths (None: not served)."""
    metrics = make_wsgi_app()

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if v1 is not None and path.startswith("/v1/"):
            return v1(environ, start_response)
        if path == "/health":
            ok, why = readiness()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [why.encode()]
        if path == "/metrics":
            return metrics(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: GET /health, /metrics, /v1/models or POST /v1/completions, /v1/chat/completions\n"]

    return app


def _deny(v1: V1App):
    """A refusal for the API-key guard: /v1/ paths as OpenAI's error object, the rest as text."""
    def deny(environ, start_response):
        path = environ.get("PATH_INFO", "")
        return (v1.deny if path.startswith("/v1/") else deny_plain)(environ, start_response)
    return deny


def start_http(host: str, port: int, readiness: Callable[[], tuple[bool, str]], api_keys: ApiKeys | None = None,
               v1: V1App | None = None) -> WSGIServer:
    """Serve in a daemon thread; returns the server (server.server_port is the bound port). With api_keys, every
    path but /health needs one of them (the /v1/ paths refuse a call as OpenAI's clients read it). v1: the app of
    the /v1/ paths."""
    app = http_app(readiness, v1)
    if api_keys is not None:
        app = guard_wsgi(app, api_keys) if v1 is None else guard_wsgi(app, api_keys, _deny(v1))
    try:
        server = make_server(host, port, app, server_class=_ThreadingServer, handler_class=_QuietHandler)
    except OSError as e:
        raise BindError(f"cannot bind {host}:{port} for HTTP ({e.strerror or e})") from None
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
