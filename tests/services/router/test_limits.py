"""Per-tenant rate limits (server.rate_limit): the buckets on a fake clock, then a router that refuses a tenant
over its budget with RESOURCE_EXHAUSTED and `retry-after`, serves another tenant meanwhile, and gives a cancelled
stream's unused tokens back."""

from __future__ import annotations

import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from blockspec.common.config import RateLimits
from blockspec.common.errors import InvalidArgument
from blockspec.common.telemetry.metrics import RouterMetrics
from blockspec.common.wire.auth import ApiKeys, client_channel
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.engine.engine import Engine
from blockspec.services.router.limits import OverLimit, TenantLimits
from tests.helpers import RouterThread, collect


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_tenants_requests_refill_evenly_over_the_minute():
    clock = Clock()
    limits = TenantLimits(RateLimits(requests_per_minute=2), clock)
    limits.admit("a", 10)
    limits.admit("a", 10)
    with pytest.raises(OverLimit, match=r"tenant 'a' is over its requests_per_minute \(2\); retry in 30 s") as err:
        limits.admit("a", 10)
    assert err.value.retry_after_s == pytest.approx(30.0) and err.value.limit == "requests_per_minute"
    limits.admit("b", 10)  # another tenant has its own bucket
    clock.now += 30.0
    limits.admit("a", 10)


def test_tokens_are_reserved_refunded_and_a_refused_request_takes_nothing():
    clock = Clock()
    limits = TenantLimits(RateLimits(requests_per_minute=3, tokens_per_minute=100), clock)
    limits.admit("a", 60)
    with pytest.raises(OverLimit, match="over its tokens_per_minute") as err:
        limits.admit("a", 60)
    assert err.value.retry_after_s == pytest.approx(12.0)  # 20 tokens at 100 a minute
    limits.refund("a", 50)  # the first request generated 10 of its 60
    limits.admit("a", 60)  # and the refused one did not use up a request
    with pytest.raises(InvalidArgument, match="max_tokens: the prompt's and max_tokens' 101 tokens exceed tenant 'a'"):
        limits.admit("a", 101)  # more than a minute's budget: waiting would not help


def test_a_daily_quota_holds_past_the_minute_and_takes_refunds():
    clock = Clock()
    limits = TenantLimits(RateLimits(tokens_per_minute=600, tokens_per_day=1000), clock)
    limits.admit("a", 600)
    clock.now += 60.0  # the minute's bucket is full again, the day's holds 400 (+ 0.7 refilled)
    limits.admit("a", 400)
    with pytest.raises(OverLimit, match="over its tokens_per_day \\(1000\\); retry in") as err:
        limits.admit("a", 100)
    assert err.value.limit == "tokens_per_day" and err.value.retry_after_s == pytest.approx(8640 - 60, rel=0.01)
    limits.refund("a", 100)  # given back to both buckets
    limits.admit("a", 100)
    with pytest.raises(InvalidArgument, match="exceed tenant 'a'.s tokens_per_day of 1000"):
        TenantLimits(RateLimits(tokens_per_day=1000), clock).admit("a", 1001)


def test_a_listed_tenant_has_its_own_limits_and_no_limits_means_off():
    config = RateLimits.model_validate({"requests_per_minute": 1, "tenants": {"big": {"requests_per_minute": 100}}})
    limits = TenantLimits(config, Clock())
    for _ in range(100):
        limits.admit("big", 1)
    limits.admit("small", 1)
    with pytest.raises(OverLimit):
        limits.admit("small", 1)
    assert limits.enabled and not TenantLimits(RateLimits()).enabled


def test_a_limited_tenant_that_no_key_names_is_refused_by_the_config(tmp_path):
    from blockspec.common.config import parse_config

    (tmp_path / "keys").write_text("team-a " + "a" * 20 + "\n")
    server = {"api_keys_file": str(tmp_path / "keys"), "rate_limit": {"tenants": {"team-a": {}, "tema-b": {}}}}
    with pytest.raises(InvalidArgument, match=r"rate_limit.tenants \['tema-b'\]: no such tenant in .*keys; known: "
                                              r"\['team-a'\]"):
        parse_config({"server": server, "model": {"target_model_path": "/models/t"}})
    with pytest.raises(InvalidArgument, match="no such tenant without server.api_keys_file"):
        parse_config({"server": {"rate_limit": {"tenants": {"team-a": {}}}}, "model": {"target_model_path": "/m"}})


KEYS = {"a" * 20: "team-a", "b" * 20: "team-b"}


@pytest.fixture(scope="module")
def limited(tiny_models):
    engine = Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2)
    limits = TenantLimits(RateLimits.model_validate({"requests_per_minute": 2, "tokens_per_minute": 400, "tenants": {
        "team-b": {"requests_per_minute": 100, "tokens_per_minute": 400}}}))
    r = RouterThread(engine, RouterMetrics(CollectorRegistry()), api_keys=ApiKeys(KEYS), limits=limits)
    yield r
    r.close()


def stub(router, key: str):
    return api_grpc.GenerationStub(client_channel(f"127.0.0.1:{router.router.port}", key))


def test_a_tenant_over_its_requests_is_told_when_to_retry_and_another_is_served(limited, prompts):
    a, b = stub(limited, "a" * 20), stub(limited, "b" * 20)
    request = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[0][:8]), max_tokens=4)
    for _ in range(2):
        assert collect(a.Generate(request, timeout=60))[2].usage.completion_tokens == 4
    with pytest.raises(grpc.RpcError) as err:
        collect(a.Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'team-a' is over its requests_per_minute (2); retry in" in err.value.details()
    assert 0 < int(dict(err.value.trailing_metadata())["retry-after"]) <= 30
    assert collect(b.Generate(request, timeout=60))[2].usage.completion_tokens == 4
    metrics = limited.router.schedulers[0].metrics
    assert metrics.rate_limited.labels(tenant="team-a", limit="requests_per_minute")._value.get() == 1
    with pytest.raises(grpc.RpcError) as err:  # a minute's budget is 400 tokens: no wait would let 8 + 500 in
        collect(b.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[0][:8]), max_tokens=500),
                           timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("max_tokens:")


def test_a_cancelled_stream_gives_its_unused_tokens_back(limited, prompts):
    """team-b reserves 8 + 380 of its 400 tokens (12 used above) and cancels after the first message. The server
    ends the stream on its own time; within 5 s a request for 308 more is admitted, which without the refund
    would wait about 45 s (400 tokens a minute)."""
    b = stub(limited, "b" * 20)
    big = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[1][:8]), max_tokens=380)
    call = b.Generate(big, timeout=60)
    next(call)
    call.cancel()
    again = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[1][:8]), max_tokens=300)
    for _ in range(50):
        try:
            assert collect(b.Generate(again, timeout=60))[2].usage.completion_tokens > 0
            return
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            time.sleep(0.1)
    pytest.fail("the cancelled stream's unused tokens did not come back")


def test_a_client_gone_while_its_submit_waits_gets_its_tokens_back(tiny_models, prompts):
    """The deadline passes while the submit waits for the step in flight: the request never ran, and its max_tokens
    go back to the tenant as a cancelled stream's unused tokens do."""
    from tests.helpers import slow_steps

    engine = Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2)
    slow_steps(2.0)(engine)  # the deadline (0.8 s) passes while a step is in flight, after the submit began
    limits, refunds = TenantLimits(RateLimits(tokens_per_day=100_000)), []
    refund = limits.refund
    limits.refund = lambda tenant, tokens: (refunds.append(tokens), refund(tenant, tokens))
    r = RouterThread(engine, limits=limits)
    try:
        busy = r.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[0]), max_tokens=4), timeout=60)
        next(busy)  # a step is in flight from now on
        with pytest.raises(grpc.RpcError) as e:
            collect(r.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[2]), max_tokens=16),
                                    timeout=0.8))
        del engine.loop.drafter.propose  # the class's own again: the rest at full speed
        collect(busy)
        deadline = time.monotonic() + 10
        while 16 not in refunds and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        r.close()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and 16 in refunds



def test_an_unset_max_tokens_is_cut_to_what_the_tenant_may_reserve_now(tiny_models, prompts):
    """max_tokens unset runs to the end of the context (512 here), more than the tenant's 100 tokens a minute: it is
    cut to what the buckets hold now, so a request after another is served too (a chat client rarely sets
    max_tokens). A prompt that alone leaves no room is refused, saying that max_tokens was unset."""
    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=2)
    r = RouterThread(engine, limits=TenantLimits(RateLimits(tokens_per_minute=100), Clock()))  # no refill meanwhile
    prompt = prompts[2]  # 7 tokens

    def generate(ids, **kw):
        return collect(r.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=ids), **kw), timeout=60))

    try:
        first = generate(prompt, max_tokens=40)[2]
        second = generate(prompt)[2]
        with pytest.raises(grpc.RpcError) as err:
            generate(prompts[7])  # 150 tokens
    finally:
        r.close()
    used = len(prompt) + first.usage.completion_tokens
    assert second.usage.completion_tokens == 100 - used - len(prompt)  # what the bucket held
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().endswith("(max_tokens was unset: as many as the limit allows, and the prompt's 150 "
                                        "leave none)")


def test_admit_up_to_grants_what_the_buckets_hold_now():
    clock = Clock()
    limits = TenantLimits(RateLimits(tokens_per_minute=100, tokens_per_day=1000), clock)
    assert limits.admit_up_to("a", 10, 500) == 90
    clock.now += 30.0  # half a minute: 50 back in the minute's bucket
    assert limits.admit_up_to("a", 10, 20) == 20 and limits.admit_up_to("a", 10, 500) == 10
    with pytest.raises(OverLimit):
        limits.admit_up_to("a", 10, 500)  # not even one fits now
