"""The router behind API keys: every gRPC method and HTTP path but health needs a known key (UNAUTHENTICATED /
401 before anything runs); with one, the API answers as without keys; the CLI's client channel sends
$BLOCKSPEC_API_KEY."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from blockspec.common.telemetry.metrics import RouterMetrics
from blockspec.common.wire.auth import ENV_API_KEY, ApiKeys, client_channel
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.engine.engine import Engine
from blockspec.services.router.http import Ready, start_http
from tests.helpers import RouterThread, collect

KEY = "k" * 24
KEYS = ApiKeys({KEY: "team-a"})


@pytest.fixture(scope="module")
def guarded(tiny_models):
    engine = Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2)
    r = RouterThread(engine, RouterMetrics(CollectorRegistry()), api_keys=KEYS)
    yield r
    r.close()


def calls(channel):
    stub = api_grpc.GenerationStub(channel)
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    return {
        "Generate": lambda: collect(stub.Generate(api_pb2.GenerateRequest(text="hello", max_tokens=4), timeout=60)),
        "Tokenize": lambda: stub.Tokenize(api_pb2.TokenizeRequest(text="hello"), timeout=10),
        "ModelInfo": lambda: stub.ModelInfo(api_pb2.ModelInfoRequest(), timeout=10),
        "reflection": lambda: next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                             timeout=10)),
    }


@pytest.mark.parametrize("key", [None, "wrong-key-of-24-chars-xx", KEY + "x"])
def test_every_method_but_health_is_unauthenticated_without_a_known_key(guarded, key):
    metrics = guarded.router.schedulers[0].metrics
    admitted = metrics.prompt_tokens._value.get()
    with client_channel(f"127.0.0.1:{guarded.router.port}", key or "") as channel:
        for name, call in calls(channel).items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "authorization: Bearer <key>" in err.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert metrics.prompt_tokens._value.get() == admitted  # the denied Generate never reached the scheduler


def test_a_known_key_from_the_environment_is_served_as_without_keys(guarded, monkeypatch, prompts, references):
    monkeypatch.setenv(ENV_API_KEY, KEY)
    with client_channel(f"127.0.0.1:{guarded.router.port}") as channel:
        results = {name: call() for name, call in calls(channel).items()}
        stub = api_grpc.GenerationStub(channel)
        ids, _, finish = collect(stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[0]),
                                                                       max_tokens=128), timeout=120))
    assert ids == references["qwen3"][0] and finish.reason in ("length", "stop")
    assert results["Generate"][2].usage.completion_tokens == 4
    assert list(results["Tokenize"].token_ids) and results["ModelInfo"].max_speculative_tokens > 0
    assert "blockspec.v1.Generation" in [s.name for s in results["reflection"].list_services_response.service]


def test_http_serves_health_to_anyone_and_metrics_only_with_a_key():
    server = start_http("127.0.0.1", 0, lambda: Ready(True, "ready\n"), KEYS)
    base = f"http://127.0.0.1:{server.server_port}"

    def get(path: str, key: str | None = None) -> int:
        request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            assert e.code != 401 or e.headers["WWW-Authenticate"].startswith("Bearer")
            return e.code

    try:
        assert get("/health") == 200
        assert get("/metrics") == 401 and get("/metrics", "wrong-key-of-24-chars-xx") == 401
        assert get("/nothing") == 401  # deny by default: an unknown path says nothing without a key
        assert get("/metrics", KEY) == 200 and get("/nothing", KEY) == 404
    finally:
        server.shutdown()
