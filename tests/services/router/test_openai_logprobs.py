"""Log-probabilities on the OpenAI-compatible API through the OpenAI client: completions' integer `logprobs` and chat's
`logprobs` / `top_logprobs`, streamed and whole, carry the engine's own values; out-of-range asks are 400s naming
the parameter."""

from __future__ import annotations

import openai
import pytest

from blockspec.common.sampling import SamplingParams
from blockspec.protos import api_pb2
from blockspec.services.engine.engine import Engine
from blockspec.services.router.messages import chat_ids
from blockspec.services.router.step_loop import TokenEvent
from tests.helpers import Served

K, NEW = 3, 12


@pytest.fixture(scope="module")
def served(chat_target):
    s = Served(Engine(chat_target, None, "ngram", max_batch=2))
    s.model_id = s.client.models.list().data[0].id
    yield s
    s.close()


def reference(chat_target, prompt_ids: list[int], top: int) -> list:
    """The in-process engine's token logprobs at the same k (the same forwards: the same bits)."""
    engine = Engine(chat_target, None, "ngram", max_batch=2)
    request = engine.request("r", prompt_ids, NEW, k=K, sampling=SamplingParams(logprobs=top))
    events = [e for e in engine.generate([request]) if isinstance(e, TokenEvent)]
    return [(t, lp) for e in events for t, lp in zip(e.token_ids, e.logprobs)]


def text_of(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_completions_logprobs_streamed_and_whole(served, chat_target, prompts, tokenizer):
    want = reference(chat_target, prompts[3], 4)
    kw = dict(model=served.model_id, prompt=prompts[3], max_tokens=NEW, temperature=0, logprobs=4,
              extra_body={"num_speculative_tokens": K})
    whole = served.client.completions.create(**kw).choices[0].logprobs
    assert whole.token_logprobs == [lp.logprob for _, lp in want]  # float32 values, exact through JSON
    assert whole.tokens == [text_of(tokenizer, t) for t, _ in want]
    assert whole.top_logprobs == [{text_of(tokenizer, t): v for t, v in zip(lp.top_ids, lp.top_logprobs)}
                                  for _, lp in want]
    assert whole.text_offset == [sum(len(s) for s in whole.tokens[:i]) for i in range(NEW)]
    chunks = [c.choices[0].logprobs for c in served.client.completions.create(**kw, stream=True) if c.choices]
    streamed = [lp for c in chunks if c is not None for lp in c.token_logprobs]
    assert streamed == whole.token_logprobs
    assert [o for c in chunks if c is not None for o in c.text_offset] == whole.text_offset


def test_chat_logprobs_streamed_and_whole(served, chat_target, tokenizer):
    messages = [{"role": "user", "content": "def wrap(self, text):"}]
    chat = api_pb2.Chat(messages=[api_pb2.ChatMessage(**m) for m in messages])
    want = reference(chat_target, chat_ids(chat, served.router.engine.tokenizer), 2)
    kw = dict(model=served.model_id, messages=messages, max_tokens=NEW, temperature=0, logprobs=True,
              top_logprobs=2, extra_body={"num_speculative_tokens": K})
    content = served.client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(content) == len(want) > 0
    assert [c.logprob for c in content] == [lp.logprob for _, lp in want]
    assert [c.token for c in content] == [text_of(tokenizer, t) for t, _ in want]
    assert [c.bytes for c in content] == [list(c.token.encode()) for c in content]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [(text_of(tokenizer, t), v) for t, v in zip(lp.top_ids, lp.top_logprobs)] for _, lp in want]
    streamed = [c for chunk in served.client.chat.completions.create(**kw, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert streamed == content
    plain = served.client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("chat", "kwargs", "param", "message"),
    [
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs: 21 is out of range [0, 20]"),
        (True, {"top_logprobs": 2}, "top_logprobs", "top_logprobs: needs logprobs: true"),
        (False, {"logprobs": 21}, "logprobs", "logprobs: 21 is out of range [0, 20]"),
        (False, {"logprobs": -1}, "logprobs", "logprobs: -1 is out of range [0, 20]"),
        (False, {"logprobs": 2, "echo": True}, "echo", "echo: echoing the prompt is not served"),
    ],
)
def test_bad_logprobs_are_400_naming_the_parameter(served, chat, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            served.client.chat.completions.create(model=served.model_id, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, **kwargs)
        else:
            served.client.completions.create(model=served.model_id, prompt="hello", max_tokens=4, **kwargs)
    assert err.value.body["param"] == param and err.value.body["message"] == message, err.value.body
