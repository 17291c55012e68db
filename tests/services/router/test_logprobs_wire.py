"""Log-probabilities over the wire: the role protocol and the public gRPC API carry the verifier's values bit for bit,
one per token, and a request for more than 20 top ones is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from blockspec.common.sampling import SamplingParams
from blockspec.protos import api_pb2
from blockspec.services.drafter.proposers.ngram import NgramProposer
from blockspec.services.engine.engine import Engine
from blockspec.services.router.roles import RemoteVerifier
from blockspec.services.router.step_loop import Request, StepLoop, TokenEvent
from blockspec.services.serving.launch import serve_verifier, verifier_service
from tests.helpers import Loop, RouterThread

PARAMS = SamplingParams(logprobs=3)


def in_process(target, prompt: list[int], k: int, new: int) -> list[TokenEvent]:
    engine = Engine(target, None, "ngram", max_batch=2)
    return [e for e in engine.generate([engine.request("r", prompt, new, k=k, sampling=PARAMS)])
            if isinstance(e, TokenEvent)]


def flat(events) -> list:
    return [lp for e in events for lp in e.logprobs]


def test_a_remote_verifier_returns_the_in_process_logprobs(tiny_models, prompts):
    target, prompt = tiny_models["qwen3"]["target"], prompts[3]
    loop = Loop()
    vsvc = verifier_service(str(target), "ngram", None, max_batch=2, max_len=256)
    server, _, port = loop.run(serve_verifier(vsvc))
    try:
        verifier = RemoteVerifier(f"127.0.0.1:{port}")
        steps = StepLoop(verifier, NgramProposer(), max_batch=2, prefill_chunk=None)
        events = [e for e in steps.run([Request("r", tuple(prompt), 16, 3, PARAMS)]) if isinstance(e, TokenEvent)]
        verifier.close()
    finally:
        loop.run(server.stop(0))
        vsvc.close()
        loop.close()
    want = in_process(target, prompt, 3, 16)
    assert [e.token_ids for e in events] == [e.token_ids for e in want]
    assert flat(events) == flat(want) and len(flat(want)) == 16 and len(flat(want)[0].top_ids) == 3


@pytest.fixture(scope="module")
def router(tiny_models):
    r = RouterThread(Engine(tiny_models["qwen3"]["target"], None, "ngram", max_batch=2))
    yield r
    r.close()


def test_generate_streams_each_tokens_logprobs(router, tiny_models, prompts):
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[3]), max_tokens=16, num_speculative_tokens=3,
                                  sampling=api_pb2.SamplingParams(logprobs=3))
    ids, got = [], []
    for msg in router.stub.Generate(req, timeout=60):
        assert len(msg.logprobs) == len(msg.token_ids)
        ids += msg.token_ids
        got += [(lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs)) for lp in msg.logprobs]
    want = flat(in_process(tiny_models["qwen3"]["target"], prompts[3], 3, 16))
    assert got == [(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in want] and len(ids) == 16


def test_generate_without_logprobs_sends_none(router, prompts):
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[3]), max_tokens=4)
    assert all(not msg.logprobs for msg in router.stub.Generate(req, timeout=60))


def test_more_than_20_top_logprobs_are_invalid_argument(router):
    req = api_pb2.GenerateRequest(text="hi", max_tokens=4, sampling=api_pb2.SamplingParams(logprobs=21))
    with pytest.raises(grpc.RpcError) as e:
        list(router.stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.logprobs: must be in [0, 20], got 21" in e.value.details()
