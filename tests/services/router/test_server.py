"""The public gRPC API over an in-process engine: streaming equals the target alone, bad requests are
INVALID_ARGUMENT naming the field, cancellation frees the slots, health and reflection answer."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from blockspec.common.config import DEFAULT_K
from blockspec.common.telemetry.metrics import DEFAULT_VERSION, RouterMetrics
from blockspec.protos import api_pb2
from blockspec.services.engine.engine import Engine
from tests.helpers import RouterThread, collect, slow_steps, wait_for

AT = {"version": DEFAULT_VERSION}  # every router metric carries its serving version


@pytest.fixture(scope="module")
def router(tiny_models):
    engine = Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=4)
    r = RouterThread(engine)
    yield r
    r.close()


def test_concurrent_streams_equal_the_target_alone(router, prompts, references, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    def one(i):
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[i]), max_tokens=128, num_speculative_tokens=4)
        return collect(router.stub.Generate(req, timeout=120))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for i, (ids, text, finish) in enumerate(results):
        assert ids == references["qwen3"][i]
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert finish.reason in ("length", "stop") and finish.usage.completion_tokens == len(ids)
        a = finish.acceptance
        assert a.drafted > 0 and sum(a.accepted_per_pos) == a.accepted
        assert a.tau == pytest.approx(1 + a.accepted / a.steps)


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"text": "", "max_tokens": 8}, "prompt: must not be empty"),
        ({"text": "hi", "max_tokens": 0}, "max_tokens: must be at least 1"),
        ({"text": "hi", "max_tokens": 8, "num_speculative_tokens": 99}, "num_speculative_tokens: must be between 0 (plain decoding) and 16"),
        ({"text": "x " * 600, "max_tokens": 8}, "prompt: "),
        ({"max_tokens": 8}, "prompt: set prompt.text, prompt.token_ids or prompt.chat"),
        ({"token_ids": api_pb2.TokenIds(ids=[1, 99999]), "max_tokens": 8}, "token_ids: id 99999 is outside"),
        ({"text": "hi", "max_tokens": 8, "sampling": api_pb2.SamplingParams(temperature=-0.5)}, "sampling.temperature: "),
        ({"text": "hi", "max_tokens": 8, "sampling": api_pb2.SamplingParams(temperature=1, rule="typical")}, "sampling.rule: "),
        ({"text": "hi", "max_tokens": 8, "sampling": api_pb2.SamplingParams(top_p=1.5)}, "sampling.top_p: "),
        ({"text": "hi", "max_tokens": 8, "sampling": api_pb2.SamplingParams(repetition_penalty=0)}, "sampling.repetition_penalty"),
        ({"text": "hi", "max_tokens": 8, "sampling": api_pb2.SamplingParams(logit_bias={99999: 1.0})}, "sampling.logit_bias: token id 99999"),
        ({"text": "hi", "max_tokens": 8, "sampling": api_pb2.SamplingParams(frequency_penalty=float("nan"))}, "sampling.frequency_penalty"),
        ({"text": "hi", "max_tokens": 8, "stop": [f"s{i}" for i in range(65)]}, "stop: at most 64 stop sequences"),
        ({"text": "hi", "max_tokens": 8, "request_id": "r" * 257}, "request_id: at most 256 characters, got 257"),
        ({"text": "hi", "max_tokens": 8, "sampling": api_pb2.SamplingParams(temperature=5e-6)},
         "sampling.temperature: must be 0 (greedy) or at least 1e-05"),
        ({"text": "hi", "max_tokens": 8, "stop": ["x" * 1001]}, "stop: at most 64 stop sequences of at most 1000"),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(router, request_kwargs, field):
    with pytest.raises(grpc.RpcError) as e:
        list(router.stub.Generate(api_pb2.GenerateRequest(**request_kwargs), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    assert collect(router.stub.Generate(api_pb2.GenerateRequest(text="ok", max_tokens=3), timeout=30))[2] is not None


def test_stop_sequence_truncates_text_and_frees_the_request(router, tokenizer, references, prompts):
    full = tokenizer.decode(references["qwen3"][3], skip_special_tokens=True)
    stop = full[20:24]
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[3]), max_tokens=128, stop=[stop])
    ids, text, finish = collect(router.stub.Generate(req, timeout=60))
    assert finish.reason == "stop_sequence" and text == full[: full.find(stop)]
    assert finish.usage.completion_tokens == len(ids)  # what the stream carried, not what was committed after it


@pytest.mark.parametrize(("max_tokens", "complete"), [(1, True), (12, True), (1, False)])
def test_a_stop_sequence_in_the_last_step_ends_the_stream_with_its_finish(router, tokenizer, references, prompts,
                                                                          max_tokens, complete):
    """The stop sequence completes with the request's last token: its step also finished the request (max_tokens),
    which the stop's cancel then no longer finds. Or (complete False) the last token is an incomplete character, so
    the stop sequence completes only in the text flushed at the finish. Either way the reason is stop_sequence."""
    texts = [tokenizer.decode(ref[:max_tokens], skip_special_tokens=True) for ref in references["qwen3"]]
    i = next(i for i, t in enumerate(texts) if t.strip() and t.endswith("\ufffd") != complete)
    stop = texts[i][-3:]
    assert texts[i].find(stop) == len(texts[i]) - len(stop), "the stop must first appear at the end"
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[i]), max_tokens=max_tokens, stop=[stop],
                                  num_speculative_tokens=4)
    ids, text, finish = collect(router.stub.Generate(req, timeout=60))
    assert ids == references["qwen3"][i][:max_tokens] and text == texts[i][: -len(stop)]
    assert finish.reason == "stop_sequence" and finish.usage.completion_tokens == max_tokens


def test_cancelled_streams_leave_no_slot_behind(router, prompts):
    free = router.engine.verifier.free_slots, router.engine.proposer.runner.cache.free_slots
    for _ in range(10):
        call = router.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[4]), max_tokens=128), timeout=60)
        next(call)
        call.cancel()
    deadline_call = router.stub.Generate(api_pb2.GenerateRequest(text="x", max_tokens=128), timeout=0.05)
    with pytest.raises(grpc.RpcError):
        list(deadline_call)
    # Cancellation is processed between steps.
    assert wait_for(lambda: (router.engine.verifier.free_slots, router.engine.proposer.runner.cache.free_slots) == free)
    assert router.engine.loop.idle


def test_model_info_tokenize_health_and_reflection(router, tokenizer):
    info = router.stub.ModelInfo(api_pb2.ModelInfoRequest())
    assert info.method == "draft_model" and info.max_speculative_tokens == 16 and info.vocab_size == len(tokenizer)
    assert info.default_speculative_tokens == DEFAULT_K
    assert list(router.stub.Tokenize(api_pb2.TokenizeRequest(text="def f():")).token_ids) == tokenizer.encode("def f():")
    health = health_pb2_grpc.HealthStub(router.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="blockspec.v1.Generation")).status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(router.channel)
    reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"blockspec.v1.Generation", "grpc.health.v1.Health"} <= names


def test_unparseable_and_unknown_field_requests_are_invalid_argument(router):
    raw = router.channel.unary_stream("/blockspec.v1.Generation/Generate", request_serializer=lambda b: b,
                                      response_deserializer=api_pb2.GenerateResponse.FromString)
    bad_utf8 = b"\x12\x03\xff\xfe\xfd" + b"\x20\x08"  # field 2 (text) with invalid UTF-8, max_tokens 8
    with pytest.raises(grpc.RpcError) as e:
        list(raw(bad_utf8, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "valid UTF-8" in e.value.details()
    unknown = api_pb2.GenerateRequest(text="hi", max_tokens=4).SerializeToString() + b"\xa0\x06\x01"  # field 100
    with pytest.raises(grpc.RpcError) as e:
        list(raw(unknown, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown field number(s) [100]" in e.value.details()
    nested = b"\x12\x02hi\x20\x04" + b"\x32\x03\x90\x03\x01"  # text, max_tokens; sampling with field 50
    with pytest.raises(grpc.RpcError) as e:
        list(raw(nested, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown field number(s) [50] for blockspec.v1.SamplingParams" in e.value.details()
    assert collect(router.stub.Generate(api_pb2.GenerateRequest(text="ok", max_tokens=2), timeout=30))[2] is not None


def _router_with(tiny_models, wrap, metrics: RouterMetrics | None = None) -> RouterThread:
    """A router over a fresh engine (draft_model) after wrap(engine) has patched one of its roles."""
    engine = Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=4)
    wrap(engine)
    return RouterThread(engine, metrics)


def test_the_first_token_streams_before_its_step_drafts(tiny_models, prompts, references):
    """The scheduler hands a prompt's first token to its stream once the prefill is done, before the speculative
    round of the same step: here that round's drafter waits until the client holds the token."""
    client_has_first, waited = threading.Event(), []

    def wrap(engine):
        propose = engine.loop.drafter.propose

        def propose_after_the_first_token(inputs):
            if not waited:
                waited.append(client_has_first.wait(30))
            return propose(inputs)

        engine.loop.drafter.propose = propose_after_the_first_token

    r = _router_with(tiny_models, wrap)
    try:
        stream = r.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[1]), max_tokens=64,
                                                         num_speculative_tokens=4), timeout=120)
        first = next(stream)
        client_has_first.set()
        ids, _, finish = collect(stream)
    finally:
        r.close()
    assert waited == [True], "the first token came only after the round"
    assert list(first.token_ids) + ids == references["qwen3"][1][:64] and finish.reason == "length"


def _failing_once(fn, name: str):
    def call(*args):
        if not getattr(call, "failed", False):
            call.failed = True
            raise RuntimeError(f"injected: {name}")
        return fn(*args)
    return call


@pytest.mark.parametrize("failing", [("verify",), ("verify", "release")])
def test_a_failing_step_fails_its_streams_and_the_next_request_is_served(failing, tiny_models, prompts, references):
    """A verify that fails ends the step's streams INTERNAL and the next request is served; with ("verify",
    "release") cancelling the failed step's requests fails too, and the streams still end (not at their deadline:
    the step thread goes on)."""
    def wrap(engine):
        for name in failing:
            setattr(engine.verifier, name, _failing_once(getattr(engine.verifier, name), name))

    registry = CollectorRegistry()
    r = _router_with(tiny_models, wrap, RouterMetrics(registry))
    request = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[2]), max_tokens=32, num_speculative_tokens=4)
    running = []  # the load gauges once the failed stream has ended (before the next request)
    try:
        with pytest.raises(grpc.RpcError) as failed:
            collect(r.stub.Generate(request, timeout=20))
        running += [registry.get_sample_value(f"blockspec_requests_{g}", {"replica": "0", **AT}) for g in ("running", "waiting")]
        ids, _, finish = collect(r.stub.Generate(request, timeout=20))
        idle = r.engine.loop.idle
    finally:
        r.close()
    assert failed.value.code() == grpc.StatusCode.INTERNAL and running == [0.0, 0.0]
    assert ids == references["qwen3"][2][:32] and finish.reason == "length" and idle


def test_a_stop_sequence_whose_release_fails_still_ends_its_stream_cleanly(tiny_models, tokenizer, references, prompts):
    """The stop sequence's cancel cannot release the request (a role down): the stream still ends with its text and
    reason (before: UNKNOWN), the failure is logged, and the next request is served."""
    def wrap(engine):
        engine.verifier.release = _failing_once(engine.verifier.release, "release")

    full = tokenizer.decode(references["qwen3"][3], skip_special_tokens=True)
    stop = full[20:24]
    r = _router_with(tiny_models, wrap)
    drafter_slots = r.engine.proposer.runner.cache.free_slots
    try:
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[3]), max_tokens=128, stop=[stop])
        _, text, finish = collect(r.stub.Generate(req, timeout=60))
        ids, _, after = collect(r.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[1]),
                                                                        max_tokens=16), timeout=60))
        drafter_freed = wait_for(lambda: r.engine.loop.idle and r.engine.proposer.runner.cache.free_slots == drafter_slots)
    finally:
        r.close()
    assert finish.reason == "stop_sequence" and text == full[: full.find(stop)]
    assert ids == references["qwen3"][1][:16] and after.reason == "length"
    assert drafter_freed  # the verifier's release failed; the drafter's ran all the same


def test_a_request_id_is_free_again_once_its_stream_ended(tiny_models, prompts, references):
    """A client that cancels and at once sends another request under the same request_id gets only that request's
    tokens: the cancelled one runs on until its cancel's turn between steps, and its events are not the new one's."""
    r = _router_with(tiny_models, slow_steps(0.2))
    try:
        first = r.stub.Generate(api_pb2.GenerateRequest(request_id="x", token_ids=api_pb2.TokenIds(ids=prompts[0]),
                                                        max_tokens=64, num_speculative_tokens=4), timeout=60)
        next(first)
        first.cancel()
        again = api_pb2.GenerateRequest(request_id="x", token_ids=api_pb2.TokenIds(ids=prompts[1]), max_tokens=16,
                                        num_speculative_tokens=4)
        ids, _, finish = collect(r.stub.Generate(again, timeout=60))
        idle = wait_for(lambda: r.engine.loop.idle)
    finally:
        r.close()
    assert ids == references["qwen3"][1][:16] and finish.reason == "length" and finish.usage.completion_tokens == 16
    assert idle


def test_a_live_request_id_is_refused_on_every_replica(tiny_models, prompts):
    """Each replica's scheduler knows only its own streams, and a second stream under a live request_id goes to the
    other, idle replica: the router itself refuses it."""
    def engine():
        return Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2)

    first, second = engine(), engine()
    slow_steps(0.2)(first)
    slow_steps(0.2)(second)
    r = RouterThread(first, replicas=(second,))
    try:
        request = api_pb2.GenerateRequest(request_id="dup", token_ids=api_pb2.TokenIds(ids=prompts[0]), max_tokens=8,
                                          num_speculative_tokens=2)
        live = r.stub.Generate(request, timeout=60)
        next(live)
        with pytest.raises(grpc.RpcError) as e:
            collect(r.stub.Generate(request, timeout=60))
        assert collect(live)[2].reason in ("length", "stop")
        assert collect(r.stub.Generate(request, timeout=60))[2] is not None  # free again once its stream ended
    finally:
        r.close()
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id: 'dup' is already running" in e.value.details()


def test_a_cancelled_streams_late_end_does_not_free_the_id_its_resend_holds(tiny_models, prompts):
    """A cancels; its id is free at once and B is sent under it while A's cancel still waits for the step in flight.
    A's end must not free B's id: C under the same id is refused, whichever replica it would land on."""
    def engine():
        e = Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2)
        slow_steps(0.5)(e)
        return e

    engines = [engine(), engine()]
    r = RouterThread(engines[0], replicas=(engines[1],))
    request = api_pb2.GenerateRequest(request_id="x", token_ids=api_pb2.TokenIds(ids=prompts[0]), max_tokens=16,
                                      num_speculative_tokens=2)
    try:
        a = r.stub.Generate(request, timeout=60)
        next(a)
        a.cancel()
        b = r.stub.Generate(request, timeout=60)
        next(b)  # B runs
        # A's end: its cancel has waited out the step in flight once only B is left in the engines (however long a
        # step takes on a loaded machine), then the event loop ends A's stream.
        assert wait_for(lambda: sum(e.loop.num_running + e.loop.num_waiting for e in engines) == 1, 60)
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:
            collect(r.stub.Generate(request, timeout=60))
        collect(b)
    finally:
        r.close()
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_a_client_gone_while_its_submit_waits_leaves_nothing_behind(tiny_models, prompts, references):
    """The deadline passes while the submit waits for the step in flight: the request is cancelled as soon as it
    joins (it does not run to max_tokens with nobody listening), and its request_id can be sent again at once."""
    r = _router_with(tiny_models, slow_steps(2.0))  # the deadline (0.8 s) passes while a step is in flight
    drafter = r.engine.loop.drafter
    free = r.engine.verifier.free_slots
    try:
        busy = r.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[0]), max_tokens=8,
                                                       num_speculative_tokens=4), timeout=60)
        next(busy)  # a step is in flight from now on
        late = api_pb2.GenerateRequest(request_id="b", token_ids=api_pb2.TokenIds(ids=prompts[2]), max_tokens=16,
                                       num_speculative_tokens=4)
        with pytest.raises(grpc.RpcError) as e:
            collect(r.stub.Generate(late, timeout=0.8))
        del drafter.propose  # the class's own again: the rest at full speed
        ids, _, finish = collect(r.stub.Generate(late, timeout=60))  # not ALREADY_EXISTS
        collect(busy)
        idle = wait_for(lambda: r.engine.loop.idle and r.engine.verifier.free_slots == free)
    finally:
        r.close()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ids == references["qwen3"][2][:16] and finish.reason == "length" and idle


def test_a_chat_prompt_is_the_targets_chat_template_rendered(chat_target, tiny_models):
    """Chat messages through the target's chat template, the assistant's turn opened: the target alone's tokens on
    that prompt. Without a template, or with messages the template refuses, INVALID_ARGUMENT naming the field."""
    from transformers import AutoTokenizer

    from tests.helpers import hf_greedy

    messages = [("system", "be brief"), ("user", "def add(a, b):")]
    tok = AutoTokenizer.from_pretrained(str(chat_target))
    rendered = tok.encode(tok.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                                  add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert rendered[-3:] == tok.encode("<|assistant|>", add_special_tokens=False)[-3:]

    def chat(*pairs):
        return api_pb2.Chat(messages=[api_pb2.ChatMessage(role=r, content=c) for r, c in pairs])

    r = RouterThread(Engine(chat_target, tiny_models["qwen3"]["other"], "draft_model", max_batch=2))
    try:
        ids, _, finish = collect(r.stub.Generate(api_pb2.GenerateRequest(chat=chat(*messages), max_tokens=24,
                                                                         num_speculative_tokens=3), timeout=60))
        with pytest.raises(grpc.RpcError) as refused:
            collect(r.stub.Generate(api_pb2.GenerateRequest(chat=chat(("user", "a"), ("user", "b")), max_tokens=4),
                                    timeout=60))
        with pytest.raises(grpc.RpcError) as empty:
            collect(r.stub.Generate(api_pb2.GenerateRequest(chat=chat(), max_tokens=4), timeout=60))
    finally:
        r.close()
    assert ids == hf_greedy(chat_target, rendered, 24) and finish.usage.prompt_tokens == len(rendered)
    assert refused.value.details() == "chat.messages: the chat template refused them: roles must alternate"
    assert empty.value.details() == "chat.messages: must not be empty"


def test_chat_template_kwargs_reach_the_template(chat_target, tiny_models):
    """template_kwargs are the template's variables (Qwen's enable_thinking); apply_chat_template's own arguments are
    not, and are refused naming the variable."""
    from transformers import AutoTokenizer

    from tests.helpers import hf_greedy

    tok = AutoTokenizer.from_pretrained(str(chat_target))
    messages = [{"role": "user", "content": "def add(a, b):"}]
    rendered = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  enable_thinking=False), add_special_tokens=False)
    assert tok.decode(rendered).endswith("<|assistant|><think>\n\n</think>\n\n")
    chat = api_pb2.Chat(messages=[api_pb2.ChatMessage(role="user", content="def add(a, b):")])
    chat.template_kwargs.update({"enable_thinking": False})
    r = RouterThread(Engine(chat_target, None, "ngram", max_batch=2))
    try:
        ids, _, finish = collect(r.stub.Generate(api_pb2.GenerateRequest(chat=chat, max_tokens=16), timeout=60))
        chat.template_kwargs.update({"tokenize": True})
        with pytest.raises(grpc.RpcError) as reserved:
            collect(r.stub.Generate(api_pb2.GenerateRequest(chat=chat, max_tokens=4), timeout=60))
    finally:
        r.close()
    assert finish.usage.prompt_tokens == len(rendered) and ids == hf_greedy(chat_target, rendered, 16)
    assert reserved.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reserved.value.details() == "chat.template_kwargs.tokenize: is set by the server, not a template variable"


def test_a_chat_prompt_without_a_template_is_refused(router):
    with pytest.raises(grpc.RpcError) as e:
        collect(router.stub.Generate(api_pb2.GenerateRequest(
            chat=api_pb2.Chat(messages=[api_pb2.ChatMessage(role="user", content="hi")]), max_tokens=4), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("chat: the target's tokenizer has no chat template")


def test_unset_max_tokens_runs_to_the_end_of_the_context(router, prompts, references):
    ids, _, finish = collect(router.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[5])),
                                                  timeout=120))
    context = router.engine.context_len
    assert ids[:128] == references["qwen3"][5][:128]
    assert finish.reason == "stop" or (finish.reason == "length" and len(prompts[5]) + len(ids) == context)


def test_the_smallest_temperature_survives_the_wire(router):
    """1e-5, the documented minimum, arrives as float32 9.9999997e-06: served, not refused as below it."""
    req = api_pb2.GenerateRequest(text="hi", max_tokens=2, sampling=api_pb2.SamplingParams(temperature=1e-5, seed=3))
    assert collect(router.stub.Generate(req, timeout=30))[2].usage.completion_tokens == 2


def test_a_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(router):
    """A text past context x the longest vocabulary entry cannot fit whatever it holds: refused at once (before, a
    4 MB text held the event loop for seconds while it was tokenized), for Generate and Tokenize alike."""
    limit = router.engine.facts().max_text_chars
    for call in (lambda text: collect(router.stub.Generate(api_pb2.GenerateRequest(text=text, max_tokens=2), timeout=30)),
                 lambda text: router.stub.Tokenize(api_pb2.TokenizeRequest(text=text), timeout=30)):
        with pytest.raises(grpc.RpcError) as e:
            call("a" * (limit + 1))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{limit + 1} characters cannot fit the context of {router.engine.context_len} tokens" in e.value.details()


def test_a_chat_template_that_raises_is_invalid_argument_on_the_messages():
    """A template is code: whatever it raises over the messages (here a TypeError) names them, never UNKNOWN."""
    from blockspec.common.errors import InvalidArgument
    from blockspec.services.router.messages import chat_ids

    class Tokenizer:
        chat_template = "{{ messages | length + 'x' }}"

        def apply_chat_template(self, messages, **kw):
            raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    chat = api_pb2.Chat(messages=[api_pb2.ChatMessage(role="user", content="hi")])
    with pytest.raises(InvalidArgument, match=r"chat.messages: the chat template failed on them: TypeError: unsupported"):
        chat_ids(chat, Tokenizer())


def test_a_long_prompt_is_tokenized_off_the_event_loop(router, monkeypatch):
    """Tokenizing the longest text the context allows took 0.4 s on the default pair, and on the event loop no
    other stream got its tokens meanwhile: texts over OFF_LOOP_CHARS go to a worker thread, shorter ones stay."""
    from blockspec.services.router.messages import OFF_LOOP_CHARS

    tokenizer = router.engine.tokenizer
    encode, threads = tokenizer.encode, []

    def recording(text, *args, **kwargs):
        threads.append(threading.current_thread())
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    long_text = "def f(x):\n    return x + 1\n" * (OFF_LOOP_CHARS // 26 + 1)
    assert OFF_LOOP_CHARS < len(long_text) <= router.engine.facts().max_text_chars
    for text in ("def f(x):", long_text):
        threads.clear()
        ids = router.stub.Tokenize(api_pb2.TokenizeRequest(text=text), timeout=30).token_ids
        assert list(ids) == encode(text) and threads
        assert (threads[-1] is router.thread) == (text != long_text)
        threads.clear()
        try:  # the long one does not fit the tiny target's context: refused, after it was tokenized
            collect(router.stub.Generate(api_pb2.GenerateRequest(text=text, max_tokens=2), timeout=30))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and text == long_text, e.details()
        assert threads and (threads[-1] is router.thread) == (text != long_text)
