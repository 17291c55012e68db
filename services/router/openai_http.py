"""The OpenAI-compatible paths of the router's HTTP port: POST /v1/completions and /v1/chat/completions (JSON, or
server-sent events with `stream`) and GET /v1/models. Each call is one call of the router's own gRPC API over
loopback, so validation, API keys, rate limits, metrics and traces are the gRPC API's: one code path."""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import grpc

from blockspec.common.auth import CHALLENGE, DENIED
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.router.openai_api import (
    ApiError,
    ChatRequest,
    Completion,
    CompletionRequest,
    OpenAIRequest,
    acceptance,
    bad_request,
    from_rpc_error,
    parse,
    to_generate,
    usage,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request body past this is refused (413) before it is read
ROUTES = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET"}
CONNECTION = "blockspec.connection"  # environ key: the client's socket (http.py puts it there)


class Answer(NamedTuple):
    status: str
    headers: list[tuple[str, str]]
    body: Iterator[bytes] | dict  # a dict is JSON, an iterator the event stream


class Upstream:
    """The router's own gRPC API, reached over loopback once the router is up; one channel for all HTTP threads."""

    def __init__(self, address: Callable[[], str | None]) -> None:
        self._address, self._stub, self._model = address, None, None
        self._lock = threading.Lock()

    def stub(self) -> api_grpc.GenerationStub:
        with self._lock:
            if self._stub is None:
                address = self._address()
                if address is None:
                    raise ApiError("503 Service Unavailable", "service_unavailable", "the server is starting")
                self._stub = api_grpc.GenerationStub(grpc.insecure_channel(address))
            return self._stub

    def model(self, metadata: tuple) -> api_pb2.ModelInfoResponse:
        """The served model (asked once: it does not change while the server runs)."""
        if self._model is None:
            try:
                self._model = self.stub().ModelInfo(api_pb2.ModelInfoRequest(), metadata=metadata, timeout=30)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
        return self._model


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def events(calls: Iterator[api_pb2.GenerateResponse], first: api_pb2.GenerateResponse, head: Completion,
           include_usage: bool) -> Iterator[bytes]:
    """The SSE body of a streamed completion. The gRPC call is cancelled when the client goes away (the WSGI server
    closes this generator), which frees the request's slots; an error after the first chunk is an `error` event."""
    try:
        message, opened = first, False
        while True:
            finish = message.finish if message.HasField("finish") else None
            if message.text or finish is not None or (head.chat and not opened):
                chunk = head.body(message.text, finish, chunk=True, first=head.chat and not opened)
                opened = True
                yield sse({**chunk, "usage": None} if include_usage else chunk)
            if finish is not None:
                if include_usage:
                    yield sse({**head.body("", None, chunk=True), "choices": [], "usage": usage(finish),
                               "acceptance": acceptance(finish)})
                break
            message = next(calls)
    except grpc.RpcError as e:
        yield sse(from_rpc_error(e).body())
    finally:
        calls.cancel()
    yield sse("[DONE]")


def client_gone(environ) -> bool:
    """The client closed its connection: a whole (not streamed) answer writes nothing before its end to notice by.
    An end of stream on the socket counts, so a client that only half-closes counts as gone too (as nginx does)."""
    sock = environ.get(CONNECTION)
    if sock is None:
        return False
    poller = select.poll()  # not select(): it fails on descriptors past 1024
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):  # nothing to read: still there (a recv would wait out the socket's timeout)
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionError:  # reset by the client
        return True
    except OSError:  # any other trouble: let the write at the end find out
        return False


def complete(upstream: Upstream, req: OpenAIRequest, environ, metadata: tuple) -> Answer:
    """One completion (chat: one reply) through the router's Generate; `X-Request-Id` is its request_id."""
    model = upstream.model(metadata).target
    if req.model is not None and req.model != model:
        raise ApiError("404 Not Found", "invalid_request_error", f"model: {req.model!r} is not served here; "
                       f"this server serves {model!r} (GET /v1/models)", "model")
    message = to_generate(req)
    message.request_id = environ.get("HTTP_X_REQUEST_ID", "")
    calls = upstream.stub().Generate(message, metadata=metadata)
    try:
        first = next(calls)  # a refused request fails here, before any header goes out
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    chat = isinstance(req, ChatRequest)
    head = Completion(f"{'chatcmpl' if chat else 'cmpl'}-{first.request_id}", int(time.time()), model, chat)
    headers = [("X-Request-Id", first.request_id)]
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return Answer("200 OK", [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"), *headers],
                      events(calls, first, head, include_usage))
    return Answer("200 OK", [("Content-Type", "application/json"), *headers], _whole(calls, first, head, environ))


def _whole(calls, first: api_pb2.GenerateResponse, head: Completion, environ) -> dict:
    text, message = [first.text], first
    try:
        while not message.HasField("finish"):
            if client_gone(environ):  # nobody will read it: free the slots now, not at max_tokens
                raise ApiError("499 Client Closed Request", "invalid_request_error", "the client closed the connection")
            message = next(calls)
            text.append(message.text)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    finally:
        if not message.HasField("finish"):  # however it ended early: the request stops with it
            calls.cancel()
    return head.body("".join(text), message.finish)


def _body(environ) -> bytes:
    try:
        size = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise bad_request("Content-Length", "not a number") from None
    if size > MAX_BODY_BYTES:
        raise ApiError("413 Content Too Large", "invalid_request_error", f"the body has {size} bytes; at most "
                       f"{MAX_BODY_BYTES} are read")
    return environ["wsgi.input"].read(size) if size > 0 else b""


def _route(upstream: Upstream, environ) -> Answer:
    path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
    header = environ.get("HTTP_AUTHORIZATION")
    metadata = (("authorization", header),) if header else ()
    if path not in ROUTES:
        raise ApiError("404 Not Found", "invalid_request_error", f"{path} is not served; the OpenAI-compatible paths "
                       "are POST /v1/completions, POST /v1/chat/completions and GET /v1/models")
    if method != ROUTES[path]:
        raise ApiError("405 Method Not Allowed", "invalid_request_error", f"{path} answers {ROUTES[path]}, not {method}",
                       headers=(("Allow", ROUTES[path]),))
    if path == "/v1/models":
        info = upstream.model(metadata)
        return Answer("200 OK", [("Content-Type", "application/json")], {"object": "list", "data": [
            {"id": info.target, "object": "model", "created": 0, "owned_by": "blockspec",
             "max_model_len": info.context_len}]})
    kind = ChatRequest if path == "/v1/chat/completions" else CompletionRequest
    return complete(upstream, parse(_body(environ), kind), environ, metadata)


def _send(start_response, answer: Answer) -> Iterator[bytes] | list[bytes]:
    if isinstance(answer.body, dict):
        data = json.dumps(answer.body).encode()
        start_response(answer.status, [*answer.headers, ("Content-Length", str(len(data)))])
        return [data]
    start_response(answer.status, answer.headers)
    return answer.body


def _error(e: ApiError) -> Answer:
    return Answer(e.status, [("Content-Type", "application/json"), *e.headers], e.body())


class V1App:
    """The WSGI app of the /v1 paths. The HTTP server's API-key guard runs before it, answering with `deny`."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def __call__(self, environ, start_response):
        try:
            answer = _route(self.upstream, environ)
        except ApiError as e:
            answer = _error(e)
        except Exception:  # noqa: BLE001 - a bug here answers 500 and is logged; the server goes on
            log.exception("%s %s failed", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))
            answer = _error(ApiError("500 Internal Server Error", "server_error", "the request failed; see server logs"))
        return _send(start_response, answer)

    @staticmethod
    def deny(environ, start_response) -> list[bytes]:
        """401 as OpenAI's clients read it: an error object."""
        return _send(start_response, _error(ApiError("401 Unauthorized", "authentication_error", DENIED,
                                                     headers=(CHALLENGE,))))
