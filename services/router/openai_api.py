"""OpenAI-compatible HTTP API on the router's HTTP port: POST /v1/completions (JSON, or server-sent events with
`stream`) and GET /v1/models. Each call is one call of the router's own gRPC API, so validation, API keys, rate
limits, metrics and traces are the gRPC API's: one code path for all of them."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from blockspec.protos import api_grpc, api_pb2

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request body past this is refused (413) before it is read
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1
# gRPC field names as the router's errors spell them -> the OpenAI parameter the client sent
_PARAMS = {"text": "prompt", "token_ids": "prompt", "token_ids.ids": "prompt"}
_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length"}  # Finish.reason -> finish_reason
_HTTP = {  # gRPC status -> (HTTP status line, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: ("400 Bad Request", "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: ("400 Bad Request", "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: ("401 Unauthorized", "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: ("403 Forbidden", "permission_error"),
    grpc.StatusCode.ALREADY_EXISTS: ("409 Conflict", "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: ("429 Too Many Requests", "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: ("503 Service Unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: ("504 Gateway Timeout", "timeout"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # one more chunk at the end: no choices, the usage


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions: OpenAI's parameters, vLLM's `top_k` and `repetition_penalty`, and ours.
    An unknown parameter, or a known one at a value this server does not serve (n > 1, echo, logprobs, ...), is a
    400 naming it, never silently dropped."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # where given, the served model's id (GET /v1/models)
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt: text or token ids
    max_tokens: int | None = 16  # OpenAI's default
    temperature: float | None = 1.0  # OpenAI's default (0 = greedy)
    top_p: float | None = 1.0
    top_k: int | None = None  # vLLM's; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None  # vLLM's (HF semantics)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted; the tenant is the API key's
    n: int | None = 1
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    num_speculative_tokens: int | None = Field(default=None, description="blockspec: this request's k")
    rule: str | None = Field(default=None, description="blockspec: the sampling verification rule")


class ApiError(Exception):
    """An answer other than 200: its HTTP status line, OpenAI error type, message and parameter."""

    def __init__(self, status: str, kind: str, message: str, param: str | None = None,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param, self.headers = status, kind, message, param, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def bad_request(param: str, message: str) -> ApiError:
    return ApiError("400 Bad Request", "invalid_request_error", f"{param}: {message}", param)


def from_rpc_error(e: grpc.RpcError) -> ApiError:
    """The router's gRPC error as OpenAI's: the status mapped, the field it names as `param`, `retry-after` kept."""
    status, kind = _HTTP.get(e.code(), ("500 Internal Server Error", "server_error"))
    message = e.details() or e.code().name
    field = message.split(": ", 1)[0] if ": " in message and " " not in message.split(": ", 1)[0] else None
    if field is not None:
        param = _PARAMS.get(field, field.removeprefix("sampling."))
        message = f"{param}: {message.split(': ', 1)[1]}"
    else:
        param = None
    headers = tuple(("Retry-After", v) for k, v in (e.trailing_metadata() or ()) if k == "retry-after")
    return ApiError(status, kind, message, param, headers)


def _unsigned(name: str, value: int | None, top: int = UINT32_MAX) -> int | None:
    if value is not None and not 0 <= value <= top:
        raise bad_request(name, f"{value} is out of range [0, {top}]")
    return value


def _refuse_unserved(req: CompletionRequest) -> None:
    """OpenAI parameters this server has one value of: any other is refused (never a silent downgrade)."""
    if req.n not in (None, 1):
        raise bad_request("n", f"{req.n}: one completion per request is served (n = 1)")
    if req.best_of not in (None, 1):
        raise bad_request("best_of", f"{req.best_of}: only 1 is served")
    if req.echo:
        raise bad_request("echo", "echoing the prompt is not served")
    if req.logprobs is not None:
        raise bad_request("logprobs", "log probabilities are not served")
    if req.suffix:
        raise bad_request("suffix", "suffixes (insertion) are not served")


def _prompt(req: CompletionRequest, message: api_pb2.GenerateRequest) -> None:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("prompt", f"{len(prompt)} prompts: one prompt per request is served")
        prompt = prompt[0]
    if isinstance(prompt, str):
        message.text = prompt
        return
    for token in prompt:
        _unsigned("prompt", token)
    message.token_ids.ids.extend(prompt)


def _sampling(req: CompletionRequest, sp: api_pb2.SamplingParams) -> None:
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            raise bad_request(name, f"{value} is not a finite number")
    sp.temperature = 1.0 if req.temperature is None else req.temperature
    sp.top_p = 1.0 if req.top_p is None else req.top_p
    sp.top_k = 0 if req.top_k in (None, -1) else _unsigned("top_k", req.top_k)
    sp.presence_penalty = req.presence_penalty or 0.0
    sp.frequency_penalty = req.frequency_penalty or 0.0
    if req.repetition_penalty is not None:
        sp.repetition_penalty = req.repetition_penalty
    if req.seed is not None:
        sp.seed = _unsigned("seed", req.seed, UINT64_MAX)
    if req.rule is not None:
        sp.rule = req.rule
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdigit():
            raise bad_request("logit_bias", f"key {key!r} is not a token id")
        if not math.isfinite(bias):
            raise bad_request("logit_bias", f"{bias} for token {key} is not a finite number")
        sp.logit_bias[_unsigned("logit_bias", int(key))] = bias


def to_generate(req: CompletionRequest) -> api_pb2.GenerateRequest:
    """The gRPC request of a completion: the router then checks every value as it checks its own clients'."""
    _refuse_unserved(req)
    message = api_pb2.GenerateRequest(max_tokens=_unsigned("max_tokens", 16 if req.max_tokens is None else req.max_tokens))
    _prompt(req, message)
    message.stop.extend([req.stop] if isinstance(req.stop, str) else req.stop or [])
    _sampling(req, message.sampling)
    if req.num_speculative_tokens is not None:
        message.num_speculative_tokens = _unsigned("num_speculative_tokens", req.num_speculative_tokens)
    return message


def parse(body: bytes) -> CompletionRequest:
    try:
        return CompletionRequest.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or "body"
        if first["type"] == "json_invalid":
            raise bad_request("body", f"not valid JSON ({first['msg']})") from None
        raise bad_request(param, first["msg"]) from None


def usage(finish: api_pb2.Finish) -> dict:
    u = finish.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def acceptance(finish: api_pb2.Finish) -> dict:
    """blockspec's extension of a completion: the request's speculation summary (README, "Observability")."""
    a = finish.acceptance
    return {"steps": a.steps, "drafted": a.drafted, "accepted": a.accepted, "tau": a.tau,
            "acceptance_rate": a.acceptance_rate, "accepted_per_pos": list(a.accepted_per_pos)}


@dataclass(frozen=True)
class Completion:
    """What every chunk or body of one completion shares."""

    id: str
    created: int
    model: str

    def body(self, text: str, finish: api_pb2.Finish | None, chunk: bool = False) -> dict:
        reason = _FINISH.get(finish.reason, finish.reason) if finish is not None else None
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}
        if finish is not None and not chunk:
            body.update(usage=usage(finish), acceptance=acceptance(finish))
        return body


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


def completion_events(calls: Iterator[api_pb2.GenerateResponse], first: api_pb2.GenerateResponse,
                      head: Completion, include_usage: bool) -> Iterator[bytes]:
    """The SSE body of a streamed completion; the gRPC call is cancelled when the client goes away (the WSGI server
    closes this generator), which frees the request's slots. An error after the first chunk is an `error` event."""
    try:
        message = first
        while True:
            finish = message.finish if message.HasField("finish") else None
            if message.text or finish is not None:
                event = head.body(message.text, finish, chunk=True)
                if include_usage:
                    event["usage"] = None
                yield sse(event)
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


def serve_completion(upstream: Upstream, req: CompletionRequest, metadata: tuple) -> tuple[str, list, Iterator[bytes] | dict]:
    """(status, headers, body): a dict body is JSON, an iterator is the event stream."""
    model = upstream.model(metadata).target
    if req.model is not None and req.model != model:
        raise ApiError("404 Not Found", "invalid_request_error", f"model: {req.model!r} is not served here; "
                       f"this server serves {model!r} (GET /v1/models)", "model")
    calls = upstream.stub().Generate(to_generate(req), metadata=metadata)
    try:
        first = next(calls)  # a refused request fails here, before any header goes out
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    head = Completion(f"cmpl-{first.request_id}", int(time.time()), model)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return "200 OK", [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")], \
            completion_events(calls, first, head, include_usage)
    text, message = [first.text], first
    try:
        while not message.HasField("finish"):
            message = next(calls)
            text.append(message.text)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    return "200 OK", [("Content-Type", "application/json")], head.body("".join(text), message.finish)


def _body(environ) -> bytes:
    try:
        size = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise bad_request("Content-Length", "not a number") from None
    if size > MAX_BODY_BYTES:
        raise ApiError("413 Content Too Large", "invalid_request_error", f"the body has {size} bytes; at most "
                       f"{MAX_BODY_BYTES} are read")
    return environ["wsgi.input"].read(size) if size > 0 else b""


def _route(upstream: Upstream, environ) -> tuple[str, list, Iterator[bytes] | dict]:
    path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
    header = environ.get("HTTP_AUTHORIZATION")
    metadata = (("authorization", header),) if header else ()
    routes = {"/v1/completions": "POST", "/v1/models": "GET"}
    if path not in routes:
        hint = " (this model has no chat template: POST /v1/completions)" if path == "/v1/chat/completions" else ""
        raise ApiError("404 Not Found", "invalid_request_error", f"{path} is not served{hint}; the OpenAI-compatible "
                       "paths are POST /v1/completions and GET /v1/models")
    if method != routes[path]:
        raise ApiError("405 Method Not Allowed", "invalid_request_error", f"{path} answers {routes[path]}, not {method}",
                       headers=(("Allow", routes[path]),))
    if path == "/v1/models":
        info = upstream.model(metadata)
        return "200 OK", [("Content-Type", "application/json")], {"object": "list", "data": [
            {"id": info.target, "object": "model", "created": 0, "owned_by": "blockspec",
             "max_model_len": info.context_len}]}
    return serve_completion(upstream, parse(_body(environ)), metadata)


def v1_app(upstream: Upstream):
    """The WSGI app of the /v1 paths (the HTTP server's API-key guard runs before it)."""

    def app(environ, start_response):
        try:
            status, headers, body = _route(upstream, environ)
        except ApiError as e:
            status, headers, body = e.status, [("Content-Type", "application/json"), *e.headers], e.body()
        except Exception:  # noqa: BLE001 - a bug here answers 500 and is logged, the server goes on
            log.exception("%s %s failed", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))
            error = ApiError("500 Internal Server Error", "server_error", "the request failed; see server logs")
            status, headers, body = error.status, [("Content-Type", "application/json")], error.body()
        if isinstance(body, dict):
            data = json.dumps(body).encode()
            start_response(status, [*headers, ("Content-Length", str(len(data)))])
            return [data]
        start_response(status, headers)
        return body

    return app
