"""The public API's messages to and from the step loop's types: a GenerateRequest checked (every error names the field)
and turned into a Request, its prompt tokenized (text, token ids or a chat through the target's template); the Finish
message of a stream."""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass

import jinja2
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from blockspec.common.errors import InvalidArgument
from blockspec.common.sampling import checked, from_pb
from blockspec.common.telemetry.metrics import DEFAULT_VERSION
from blockspec.protos import api_pb2
from blockspec.services.router.step_loop import FinishEvent, Request
from blockspec.services.router.validation import validate_request, validate_stops


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
    sampling = checked(from_pb(msg.sampling), facts.vocab_size)
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
