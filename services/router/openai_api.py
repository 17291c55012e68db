"""OpenAI's API as the router's gRPC API: the bodies of /v1/completions and /v1/chat/completions as a
GenerateRequest, the router's answers and errors as OpenAI's (the HTTP side: openai_http.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, ValidationError

from blockspec.common.sampling import MAX_LOGPROBS
from blockspec.protos import api_pb2
from blockspec.services.router import openai_logprobs

UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "TextPart", "StreamOptions"}  # pydantic's union members
# gRPC field names as the router's errors spell them -> the OpenAI parameter the client sent
_PARAMS = {"text": "prompt", "token_ids": "prompt", "token_ids.ids": "prompt", "chat": "messages",
           "chat.messages": "messages", "chat.template_kwargs": "chat_template_kwargs", "request_id": "X-Request-Id"}
_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length"}  # Finish.reason -> finish_reason
_HTTP = {  # gRPC status -> (HTTP status line, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: ("400 Bad Request", "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: ("400 Bad Request", "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: ("401 Unauthorized", "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: ("403 Forbidden", "permission_error"),
    grpc.StatusCode.ALREADY_EXISTS: ("409 Conflict", "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: ("429 Too Many Requests", "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: ("503 Service Unavailable", "service_unavailable"),
    grpc.StatusCode.CANCELLED: ("503 Service Unavailable", "service_unavailable"),  # the server stopping: retry
    grpc.StatusCode.DEADLINE_EXCEEDED: ("504 Gateway Timeout", "timeout"),
}


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
    message, param = e.details() or e.code().name, None
    field, sep, rest = message.partition(": ")
    if sep and " " not in field:  # "field: what is wrong" (common/errors.InvalidArgument)
        param = _PARAMS.get(field, field.removeprefix("sampling."))
        if field.startswith("chat.template_kwargs."):  # one of its variables: chat_template_kwargs.<name>
            param = "chat_template_kwargs." + field.removeprefix("chat.template_kwargs.")
        message = f"{param}: {rest}"
    headers = tuple(("Retry-After", v) for k, v in (e.trailing_metadata() or ()) if k == "retry-after")
    return ApiError(status, kind, message, param, headers)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "8" is not 8, nor true 1
    include_usage: bool = False  # one more chunk at the end: no choices, the usage


class OpenAIRequest(BaseModel):
    """The parameters both endpoints share: OpenAI's, vLLM's `top_k` and `repetition_penalty`, and ours. An unknown
    parameter, a value of another JSON type (strict: "8" for an integer, true for a number, "yes" for a boolean), or a
    known one at a value not served (n > 1, top_logprobs 21, ...) is a 400 naming it, never dropped or coerced."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "8" is not 8, nor true 1
    model: str | None = None  # where given, the served model's id (GET /v1/models)
    max_tokens: int | None = None
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
    num_speculative_tokens: int | None = None  # blockspec: this request's k
    rule: str | None = None  # blockspec: the sampling verification rule

    def served_max_tokens(self) -> int | None:
        return self.max_tokens

    def served_logprobs(self) -> int | None:
        """Top log-probabilities asked per token (None: none asked)."""
        return None

    def unserved(self) -> dict[str, str | None]:
        """Parameter -> why its value is not served (None: it is). Subclasses add their endpoint's."""
        return {"n": f"{self.n}: one completion per request is served (n = 1)" if self.n not in (None, 1) else None}


class CompletionRequest(OpenAIRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt: text or token ids
    max_tokens: int | None = 16  # OpenAI's default for completions
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None

    def served_logprobs(self) -> int | None:
        return _logprobs("logprobs", self.logprobs)

    def unserved(self) -> dict[str, str | None]:
        return {**super().unserved(),
                "best_of": "only 1 is served" if self.best_of not in (None, 1) else None,
                "echo": "echoing the prompt is not served" if self.echo else None,
                "suffix": "suffixes (insertion) are not served" if self.suffix else None}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "8" is not 8, nor true 1
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "8" is not 8, nor true 1
    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(OpenAIRequest):
    """POST /v1/chat/completions. Without max_tokens, the reply may run to the end of the context (OpenAI's)."""

    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template
    response_format: dict | None = None

    def unserved(self) -> dict[str, str | None]:
        return {**super().unserved(),
                "top_logprobs": "needs logprobs: true" if self.top_logprobs is not None and not self.logprobs else None,
                "tools": "tool calls are not served" if self.tools else None,
                "tool_choice": "tool calls are not served" if self.tool_choice not in (None, "none") else None,
                "response_format": 'only {"type": "text"} is served'
                if self.response_format not in (None, {"type": "text"}) else None}

    def served_logprobs(self) -> int | None:
        return _logprobs("top_logprobs", self.top_logprobs or 0) if self.logprobs else None

    def served_max_tokens(self) -> int | None:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_completion_tokens", f"{self.max_completion_tokens} differs from max_tokens "
                              f"{self.max_tokens}; set one")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _logprobs(name: str, value: int | None) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(name, f"{value} is out of range [0, {MAX_LOGPROBS}]")
    return value


def parse(body: bytes, model: type[OpenAIRequest]) -> OpenAIRequest:
    """The body as `model`; ApiError 400 naming the first parameter at fault (its path: `messages.0.role`)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise bad_request("body", f"not valid JSON ({first['msg']})") from None
        # pydantic names the union member it tried ("prompt.str", "content.list[TextPart]"): the parameter ends before
        path = [str(part) for part in first["loc"]]
        path = path[: next((i for i, part in enumerate(path) if part in _TYPE_TAGS or "[" in part), len(path))]
        raise bad_request(".".join(path) or "body", first["msg"]) from None


def _unsigned(name: str, value: int | None, top: int = UINT32_MAX) -> int | None:
    if value is not None and not 0 <= value <= top:
        raise bad_request(name, f"{value} is out of range [0, {top}]")
    return value


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


def _messages(req: ChatRequest, message: api_pb2.GenerateRequest) -> None:
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content or ())
        message.chat.messages.add(role=m.role, content=content)
    if not req.messages:
        message.chat.SetInParent()  # an empty conversation: the router names it
    if req.chat_template_kwargs:
        message.chat.template_kwargs.update(req.chat_template_kwargs)


def _sampling(req: OpenAIRequest, sp: api_pb2.SamplingParams) -> None:
    """Ranges (NaN and inf too) are the router's to check (common/sampling.checked): its error names the field."""
    sp.temperature = 1.0 if req.temperature is None else req.temperature
    sp.top_p = 1.0 if req.top_p is None else req.top_p
    sp.top_k = 0 if req.top_k in (None, -1) else _unsigned("top_k", req.top_k)
    if req.top_p == 0:  # nucleus sampling's limit, the most likely token alone (gRPC reads top_p 0 as unset)
        sp.top_p, sp.top_k = 1.0, 1
    sp.presence_penalty = req.presence_penalty or 0.0
    sp.frequency_penalty = req.frequency_penalty or 0.0
    if req.repetition_penalty is not None:
        sp.repetition_penalty = req.repetition_penalty
    if req.seed is not None:
        sp.seed = _unsigned("seed", req.seed, UINT64_MAX)
    if req.rule is not None:
        sp.rule = req.rule
    for key, bias in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdecimal()):
            raise bad_request("logit_bias", f"key {key!r} is not a token id")
        sp.logit_bias[_unsigned("logit_bias", int(key))] = bias


def to_generate(req: OpenAIRequest) -> api_pb2.GenerateRequest:
    """The gRPC request of a completion: the router then checks every value as it checks its own clients'."""
    for param, why in req.unserved().items():  # never a silent downgrade
        if why:
            raise bad_request(param, why)
    message = api_pb2.GenerateRequest()
    max_tokens = req.served_max_tokens()
    if max_tokens is not None:
        message.max_tokens = _unsigned("max_tokens", max_tokens)
    if isinstance(req, ChatRequest):
        _messages(req, message)
    else:
        _prompt(req, message)
    message.stop.extend([req.stop] if isinstance(req.stop, str) else req.stop or [])
    _sampling(req, message.sampling)
    logprobs = req.served_logprobs()
    if logprobs is not None:
        message.sampling.logprobs = logprobs
    if req.num_speculative_tokens is not None:
        message.num_speculative_tokens = _unsigned("num_speculative_tokens", req.num_speculative_tokens)
    return message


def usage(finish: api_pb2.Finish) -> dict:
    u = finish.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def acceptance(finish: api_pb2.Finish) -> dict:
    """blockspec's extension of a completion: the request's speculation summary (docs/observability.md)."""
    a = finish.acceptance
    return {"steps": a.steps, "drafted": a.drafted, "accepted": a.accepted, "tau": a.tau,
            "acceptance_rate": a.acceptance_rate, "accepted_per_pos": list(a.accepted_per_pos)}


@dataclass(frozen=True)
class Completion:
    """What every chunk or body of one completion (chat: one reply) shares, and their shapes."""

    id: str
    created: int
    model: str
    chat: bool
    version: str = ""  # the serving version that answered: OpenAI's `system_fingerprint`
    logprobs: bool = False  # the request asks for its tokens' log-probabilities

    def body(self, text: str, finish: api_pb2.Finish | None, chunk: bool = False, first: bool = False,
             logprobs: Sequence[api_pb2.TokenLogprob] = (), offset: int = 0) -> dict:
        """A whole completion (chunk False: finish set, with usage and acceptance) or one streamed chunk. logprobs:
        its tokens' (where the request asks); offset: a completion's token texts' length before them."""
        reason = _FINISH.get(finish.reason, finish.reason) if finish is not None else None
        kind = ("chat.completion" + ".chunk" * chunk) if self.chat else "text_completion"
        shaped = (None if not self.logprobs else openai_logprobs.chat(logprobs) if self.chat
                  else openai_logprobs.completion(logprobs, offset))
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.version or None,
                "choices": [{"index": 0, **self._text(text, chunk, first), "logprobs": shaped, "finish_reason": reason}]}
        if finish is not None and not chunk:
            body.update(usage=usage(finish), acceptance=acceptance(finish))
        return body

    def _text(self, text: str, chunk: bool, first: bool) -> dict:
        if not self.chat:
            return {"text": text}
        if not chunk:
            return {"message": {"role": "assistant", "content": text}}
        return {"delta": {"role": "assistant", "content": text} if first else {"content": text} if text else {}}
