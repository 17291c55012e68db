"""The OpenAI-compatible paths of the router's HTTP port: POST /v1/completions and /v1/chat/completions (JSON, or
server-sent events with `stream`) and GET /v1/models, an ASGI app on the HTTP front (http.py). Each call is one call of
the router's own gRPC API over loopback, so validation, API keys, rate limits, metrics and traces are the gRPC API's:
one code path."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

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
from blockspec.services.router.server import VERSION_HEADER

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request body past this is refused (413), declared or streamed (chunked)
# A header value that travels on as gRPC metadata (Authorization) or an id past this is refused (431, naming it): gRPC
# refuses metadata over 8 KiB at random and over 16 KiB always, as RESOURCE_EXHAUSTED, which reads as a rate limit.
MAX_HEADER_VALUE_BYTES = 4096
BODY_TIMEOUT_S = 30.0  # a body not received whole in this long is refused (408) and its connection closed
MODEL_INFO_S = 1.0  # the served model's name is asked again after this long (a rollout changes it)
ROUTES = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET"}


class Upstream:
    """The router's own gRPC API, reached over loopback once the router is up; one channel, made in the HTTP front's
    event loop, for every request. channel(address): how to reach it (default: plaintext)."""

    def __init__(self, address: Callable[[], str | None],
                 channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel) -> None:
        self._address, self._channel, self._stub, self._model = address, channel, None, None

    def stub(self) -> api_grpc.GenerationStub:
        if self._stub is None:
            address = self._address()
            if address is None:
                raise ApiError("503 Service Unavailable", "service_unavailable", "the server is starting")
            self._stub = api_grpc.GenerationStub(self._channel(address))
        return self._stub

    async def model(self, metadata: tuple) -> api_pb2.ModelInfoResponse:
        """The served model, asked again after MODEL_INFO_S (a rollout changes it)."""
        if self._model is None or time.monotonic() - self._model[0] > MODEL_INFO_S:
            try:
                info = await self.stub().ModelInfo(api_pb2.ModelInfoRequest(), metadata=metadata, timeout=30)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
            self._model = (time.monotonic(), info)
        return self._model[1]


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def events(call, first: api_pb2.GenerateResponse, head: Completion, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion. The gRPC call is cancelled when the client goes away (the response's
    task is cancelled), which frees the request's slots; an error after the first chunk is an `error` event."""
    try:
        message, opened, offset = first, False, 0
        while True:
            finish = message.finish if message.HasField("finish") else None
            logprobs = message.logprobs if head.logprobs else ()
            if message.text or logprobs or finish is not None or (head.chat and not opened):
                chunk = head.body(message.text, finish, chunk=True, first=head.chat and not opened,
                                  logprobs=logprobs, offset=offset)
                offset += sum(len(lp.token) for lp in logprobs)
                opened = True
                yield sse({**chunk, "usage": None} if include_usage else chunk)
            if finish is not None:
                if include_usage:
                    yield sse({**head.body("", None, chunk=True), "choices": [], "usage": usage(finish),
                               "acceptance": acceptance(finish)})
                break
            message = await _next(call)
    except grpc.RpcError as e:
        yield sse(from_rpc_error(e).body())
    finally:
        call.cancel()
    yield sse("[DONE]")


async def _next(call) -> api_pb2.GenerateResponse:
    message = await call.read()
    if message is grpc.aio.EOF:  # the router ends every stream with a finish; this is its failure
        raise ApiError("502 Bad Gateway", "server_error", "the stream ended without a finish")
    return message


def header(request: Request, name: str) -> str | None:
    """A request header's value, which must be printable ASCII (it goes into gRPC metadata, a response header or an
    id): 400 naming the header otherwise; 431 naming it past MAX_HEADER_VALUE_BYTES."""
    raw = request.headers.get(name)
    if raw is not None and len(raw) > MAX_HEADER_VALUE_BYTES:
        raise ApiError("431 Request Header Fields Too Large", "invalid_request_error",
                       f"{name}: {len(raw)} bytes; at most {MAX_HEADER_VALUE_BYTES} are read", name)
    if raw is not None and not all(" " <= ch <= "~" for ch in raw):
        raise bad_request(name, "must be printable ASCII (no control or non-ASCII characters)")
    return raw


def json_body(request: Request) -> None:
    """A body's Content-Type, where given, must be JSON (application/json, or a +json type): 415 naming it otherwise."""
    given = request.headers.get("content-type")
    media = (given or "").split(";")[0].strip().lower()
    if given is not None and media != "application/json" and not media.endswith("+json"):
        raise ApiError("415 Unsupported Media Type", "invalid_request_error",
                       f"Content-Type: {given[:100]!r}; the body is read as JSON: send application/json",
                       "Content-Type")


async def complete(upstream: Upstream, req: OpenAIRequest, request: Request, metadata: tuple) -> Response:
    """One completion (chat: one reply) through the router's Generate; `X-Request-Id` is its request_id."""
    model = (await upstream.model(metadata)).target
    if req.model is not None and req.model != model:
        raise ApiError("404 Not Found", "invalid_request_error", f"model: {req.model!r} is not served here; "
                       f"this server serves {model!r} (GET /v1/models)", "model")
    message = to_generate(req)
    message.request_id = header(request, "X-Request-Id") or ""
    call = upstream.stub().Generate(message, metadata=metadata)
    try:
        first = await _next(call)  # a refused request fails here, before any header goes out
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    except BaseException:
        call.cancel()
        raise
    chat = isinstance(req, ChatRequest)
    version = dict(await call.initial_metadata()).get(VERSION_HEADER, "")
    head = Completion(f"{'chatcmpl' if chat else 'cmpl'}-{first.request_id}", int(time.time()), model, chat, version,
                      req.served_logprobs() is not None)
    headers = {"X-Request-Id": first.request_id, "X-Blockspec-Version": version}
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(events(call, first, head, include_usage),  # no charset: SSE is UTF-8
                                 headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    return JSONResponse(await _whole(call, first, head, request), headers=headers)


async def _whole(call, first: api_pb2.GenerateResponse, head: Completion, request: Request) -> dict:
    """The whole answer. Nothing is written before its end, so the client's going away is watched meanwhile: the
    request is cancelled then instead of running to max_tokens for nobody."""
    async def collect() -> tuple[list[str], list[api_pb2.TokenLogprob], api_pb2.GenerateResponse]:
        text, logprobs, message = [first.text], list(first.logprobs), first
        while not message.HasField("finish"):
            message = await _next(call)
            text.append(message.text)
            logprobs.extend(message.logprobs)
        return text, logprobs, message

    collecting, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((collecting, gone), return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():
            raise ApiError("499 Client Closed Request", "invalid_request_error", "the client closed the connection")
        text, logprobs, message = collecting.result()
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    finally:
        gone.cancel()
        if not collecting.done() or collecting.exception() is not None:  # ended early: the request stops with it
            collecting.cancel()
            call.cancel()
    return head.body("".join(text), message.finish, logprobs=logprobs)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (an end of stream counts: a client that only half-closes is gone too)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _body(request: Request) -> bytes:
    """The body, whole: at most MAX_BODY_BYTES (declared or streamed in chunks), within BODY_TIMEOUT_S."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(int(declared))
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _too_large(size)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError("408 Request Timeout", "invalid_request_error", f"body: not received whole within "
                       f"{BODY_TIMEOUT_S:g} s", "body", headers=(("Connection", "close"),)) from None
    except ClientDisconnect:
        raise ApiError("499 Client Closed Request", "invalid_request_error", "the client closed the connection") from None
    return b"".join(chunks)


def _too_large(size: int) -> ApiError:
    return ApiError("413 Content Too Large", "invalid_request_error", f"body: {size} bytes or more; at most "
                    f"{MAX_BODY_BYTES} are read", "body", headers=(("Connection", "close"),))


async def _route(upstream: Upstream, request: Request) -> Response:
    path, method = request.url.path, request.method
    authorization = header(request, "Authorization")
    metadata = (("authorization", authorization),) if authorization else ()
    if path not in ROUTES:
        raise ApiError("404 Not Found", "invalid_request_error", f"{path} is not served; the OpenAI-compatible paths "
                       "are POST /v1/completions, POST /v1/chat/completions and GET /v1/models")
    if method != ROUTES[path]:
        raise ApiError("405 Method Not Allowed", "invalid_request_error", f"{path} answers {ROUTES[path]}, not {method}",
                       headers=(("Allow", ROUTES[path]),))
    if path == "/v1/models":
        info = await upstream.model(metadata)
        return JSONResponse({"object": "list", "data": [
            {"id": info.target, "object": "model", "created": 0, "owned_by": "blockspec",
             "max_model_len": info.context_len}]})
    kind = ChatRequest if path == "/v1/chat/completions" else CompletionRequest
    json_body(request)
    return await complete(upstream, parse(await _body(request), kind), request, metadata)


def error_response(e: ApiError) -> Response:
    """An ApiError as OpenAI's clients read it: its status and an error object."""
    return JSONResponse(e.body(), int(e.status.split()[0]), headers=dict(e.headers))


class V1App:
    """The ASGI app of the /v1 paths. The HTTP front's API-key guard runs before it."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        try:
            response = await _route(self.upstream, request)
        except ApiError as e:
            response = error_response(e)
        except Exception:  # a bug here answers 500 and is logged; the server goes on
            log.exception("%s %s failed", request.method, request.url.path)
            response = error_response(ApiError("500 Internal Server Error", "server_error",
                                               "the request failed; see server logs"))
        await response(scope, receive, send)
