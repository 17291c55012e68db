"""The OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) through the OpenAI Python
client: the target alone's text streamed and in one body, OpenAI-shaped errors naming the parameter, keys and rate
limits as on gRPC, and a client that leaves mid-stream frees its slot."""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest
from prometheus_client import CollectorRegistry

from blockspec.common.config import RateLimits
from blockspec.common.telemetry.metrics import DEFAULT_VERSION, RouterMetrics
from blockspec.common.wire.auth import ApiKeys
from blockspec.services.engine.engine import Engine
from blockspec.services.router.limits import TenantLimits
from tests.helpers import SERVED_KEY, Served

AT = {"version": DEFAULT_VERSION}  # every router metric carries its serving version

@pytest.fixture(scope="module")
def served(tiny_models):
    registry = CollectorRegistry()
    s = Served(Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=4),
               metrics=RouterMetrics(registry))
    s.registry = registry
    yield s
    s.close()


@pytest.fixture(scope="module")
def model_id(served):
    (model,) = served.client.models.list().data
    served.model_id = model.id
    return model.id


def test_models_lists_the_served_target(served, model_id, tiny_models):
    assert model_id == str(tiny_models["qwen3"]["target"])
    status, _, body = served.raw("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["max_model_len"] > 0


@pytest.mark.parametrize(("i", "k"), [(0, 2), (3, 4), (5, 7)])
def test_streamed_and_whole_completions_are_the_target_alones_text(served, model_id, prompts, references, tokenizer, i, k):
    expected = tokenizer.decode(references["qwen3"][i], skip_special_tokens=True)
    kw = dict(model=model_id, prompt=prompts[i], max_tokens=128, temperature=0, extra_body={"num_speculative_tokens": k})
    whole = served.client.completions.create(**kw)
    assert whole.choices[0].text == expected and whole.id.startswith("cmpl-")
    assert whole.usage.completion_tokens == len(references["qwen3"][i])
    assert whole.choices[0].finish_reason == ("length" if len(references["qwen3"][i]) == 128 else "stop")
    acceptance = whole.model_extra["acceptance"]
    assert acceptance["drafted"] > 0 and sum(acceptance["accepted_per_pos"]) == acceptance["accepted"]
    chunks = list(served.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_a_stop_sequence_ends_the_text_before_it(served, model_id, prompts, references, tokenizer):
    text = tokenizer.decode(references["qwen3"][1], skip_special_tokens=True)
    stop = text[20:24]
    out = served.client.completions.create(model=model_id, prompt=prompts[1], max_tokens=128, temperature=0, stop=[stop])
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"temperature": -1}, "temperature", "temperature: "),
        ({"top_p": 1.5}, "top_p", "top_p: "),
        ({"n": 2}, "n", "n: 2: one completion per request"),
        ({"logprobs": 21}, "logprobs", "logprobs: 21 is out of range [0, 20]"),
        ({"echo": True}, "echo", "echo: "),
        ({"max_tokens": -3}, "max_tokens", "max_tokens: -3 is out of range"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens: must be at least 1"),
        ({"prompt": [1, 99999]}, "prompt", "prompt: id 99999 is outside"),
        ({"prompt": ["a", "b"]}, "prompt", "prompt: 2 prompts"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias: key 'x' is not a token id"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "logit_bias: key '\u00b2' is not a token id"),  # isdigit() but no int
        ({"prompt": 5}, "prompt", "prompt: Input should be a valid string"),  # not pydantic's "prompt.str"
        ({"extra_body": {"num_speculative_tokens": 99}}, "num_speculative_tokens", "num_speculative_tokens: must be between"),
        ({"extra_body": {"best_answer": 1}}, "best_answer", "best_answer: Extra inputs are not permitted"),
        ({"extra_body": {"rule": "typical"}}, "rule", "rule: "),
        ({"max_tokens": "8"}, "max_tokens", "max_tokens: Input should be a valid integer"),  # strict: not coerced
        ({"max_tokens": True}, "max_tokens", "max_tokens: Input should be a valid integer"),
        ({"extra_body": {"stream": "yes"}}, "stream", "stream: Input should be a valid boolean"),
        ({"temperature": "0.5"}, "temperature", "temperature: Input should be a valid number"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(served, model_id, kwargs, param, message):
    kw = {"model": model_id, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(**kw)
    error = err.value.body
    assert error["param"] == param and error["message"].startswith(message), error
    assert error["type"] == "invalid_request_error"


def test_what_is_not_served_gets_an_error_that_says_so(served, model_id):
    with pytest.raises(openai.NotFoundError, match="'gpt-x' is not served here"):
        served.client.completions.create(model="gpt-x", prompt="hello", max_tokens=4)
    status, _, body = served.raw("POST", "/v1/completions", b'{"prompt": "hi",')
    assert status == 400 and json.loads(body)["error"]["message"].startswith("body: not valid JSON")
    for param in ("temperature", "presence_penalty"):  # JSON's NaN: the router's range check names the parameter
        status, _, body = served.raw("POST", "/v1/completions", f'{{"prompt": "hi", "{param}": NaN}}'.encode())
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == param and error["message"].startswith(f"{param}: must be a number")
    status, headers, _ = served.raw("GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST"
    status, _, body = served.raw("POST", "/v1/embeddings", b"{}")
    assert status == 404 and "POST /v1/chat/completions" in json.loads(body)["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:  # the tiny target's tokenizer has no chat template
        served.client.chat.completions.create(model=served.model_id, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "messages" and "no chat template" in err.value.body["message"]
    status, _, _ = served.raw("GET", "/health")
    assert status == 200


def test_a_client_that_leaves_mid_stream_frees_its_slot(served, model_id, prompts):
    verifier = served.router.engine.verifier
    free = verifier.free_slots
    cancelled = {"reason": "cancelled", **AT}
    before = served.registry.get_sample_value("blockspec_requests_finished_total", cancelled) or 0
    body = json.dumps({"model": model_id, "prompt": prompts[2], "max_tokens": 500 - len(prompts[2]), "temperature": 0,
                       "stream": True, "num_speculative_tokens": 1}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    assert response.readline().startswith(b"data: {")
    response.close()
    conn.close()  # gone mid-stream: a write fails, the gRPC call is cancelled
    deadline = time.monotonic() + 30
    while verifier.free_slots != free and time.monotonic() < deadline:
        time.sleep(0.05)
    assert verifier.free_slots == free
    assert served.registry.get_sample_value("blockspec_requests_finished_total", cancelled) == before + 1


def test_a_client_that_leaves_before_a_whole_answer_cancels_it(served, model_id, prompts):
    """Without `stream` nothing is written before the end: the server notices the closed connection between
    messages and cancels the request, instead of running it to max_tokens for nobody."""
    cancelled = {"reason": "cancelled", **AT}
    before = served.registry.get_sample_value("blockspec_requests_finished_total", cancelled) or 0
    body = json.dumps({"model": model_id, "prompt": prompts[2], "max_tokens": 500 - len(prompts[2]), "temperature": 0,
                       "num_speculative_tokens": 1}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    conn.close()
    deadline = time.monotonic() + 30
    while (served.registry.get_sample_value("blockspec_requests_finished_total", cancelled) or 0) == before \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.registry.get_sample_value("blockspec_requests_finished_total", cancelled) == before + 1


def test_x_request_id_names_the_request_and_a_live_one_is_409(served, model_id, prompts):
    kw = dict(model=model_id, prompt=prompts[2], temperature=0, extra_headers={"X-Request-Id": "mine"})
    live = served.client.completions.create(**kw, max_tokens=400, stream=True, extra_body={"num_speculative_tokens": 1})
    first = next(iter(live))
    with pytest.raises(openai.ConflictError) as err:
        served.client.completions.create(**kw, max_tokens=4)
    live.close()
    assert first.id == "cmpl-mine" and "X-Request-Id: 'mine' is already running" in err.value.body["message"]


def test_keys_and_rate_limits_answer_as_on_grpc(tiny_models, prompts):
    keys = ApiKeys({SERVED_KEY: "team-a"})
    limits = TenantLimits(RateLimits(requests_per_minute=1, tenants={"team-a": RateLimits(requests_per_minute=1)}))
    s = Served(Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=2), api_keys=keys, limits=limits)
    try:
        anonymous = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="nobody-" * 4, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as denied:
            anonymous.completions.create(model="any", prompt=prompts[0], max_tokens=4)
        assert denied.value.body["type"] == "authentication_error"  # an error object, as on every /v1 answer
        (model,) = s.client.models.list().data
        served = s.client.completions.create(model=model.id, prompt=prompts[0], max_tokens=4)
        assert 1 <= served.usage.completion_tokens <= 4  # the random target may end its text early
        with pytest.raises(openai.RateLimitError) as err:
            s.client.completions.create(model=model.id, prompt=prompts[0], max_tokens=4)
        assert int(err.value.response.headers["Retry-After"]) > 0
        assert "requests_per_minute" in err.value.body["message"]
    finally:
        s.close()


def test_chat_completions_are_the_target_alones_reply_to_the_rendered_conversation(chat_target, tiny_models):
    """/v1/chat/completions: the messages through the target's chat template, the reply streamed (a first chunk
    opening the assistant's turn, then content deltas, then the finish) and whole; errors name the parameter."""
    from transformers import AutoTokenizer

    from tests.helpers import hf_greedy

    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]}]
    tok = AutoTokenizer.from_pretrained(str(chat_target))
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    rendered = tok.encode(tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    expected = tok.decode(hf_greedy(chat_target, rendered, 24), skip_special_tokens=True)
    s = Served(Engine(chat_target, tiny_models["qwen3"]["other"], "draft_model", max_batch=2))
    try:
        kw = dict(model=str(chat_target), messages=messages, max_tokens=24, temperature=0)
        whole = s.client.chat.completions.create(**kw)
        chunks = list(s.client.chat.completions.create(**kw, stream=True))
        newer = s.client.chat.completions.create(**{**kw, "max_tokens": None}, max_completion_tokens=24)
        with pytest.raises(openai.BadRequestError) as alternate:
            s.client.chat.completions.create(**{**kw, "messages": [flat[1], flat[1]]})
        with pytest.raises(openai.BadRequestError) as tools:
            s.client.chat.completions.create(**kw, tools=[{"type": "function", "function": {"name": "f"}}])
        no_thinking = s.client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        with pytest.raises(openai.BadRequestError) as reserved:
            s.client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    finally:
        s.close()
    thinking_off = tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert no_thinking.usage.prompt_tokens == len(tok.encode(thinking_off, add_special_tokens=False)) > len(rendered)
    assert reserved.value.body["param"] == "chat_template_kwargs.add_generation_prompt"
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(rendered) and newer.choices[0].message.content == expected
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert alternate.value.body["param"] == "messages" and "roles must alternate" in alternate.value.body["message"]
    assert tools.value.body["param"] == "tools"
