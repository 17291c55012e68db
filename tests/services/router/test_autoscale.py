"""The autoscaling policy: desired replicas from the queue, HPA-style, with delays both ways."""

from __future__ import annotations

import pytest

from blockspec.common.config import AutoscalingConfig, ServerConfig
from blockspec.services.router.autoscale import QueuePolicy


def policy(**kw) -> QueuePolicy:
    return QueuePolicy(AutoscalingConfig(**{"min_replicas": 1, "max_replicas": 4, "target_waiting_per_replica": 2.0,
                                            "scale_up_delay_s": 10.0, "scale_down_delay_s": 60.0, **kw}))


def test_the_queue_asks_for_ceil_waiting_over_target_within_the_bounds():
    p = policy()
    assert [p.wanted(w) for w in (0, 1, 2, 3, 5, 8, 100)] == [1, 1, 1, 2, 3, 4, 4]


def test_a_scale_up_waits_its_delay_and_goes_to_what_the_queue_asks():
    p = policy()
    assert p.decide(7, 1, now=0.0) is None
    assert p.decide(7, 1, now=9.9) is None
    decision = p.decide(7, 1, now=10.0)
    assert decision.replicas == 4 and "7 requests waiting over 1 replicas" in decision.reason
    assert p.decide(7, 4, now=10.5) is None  # at max: nothing more


def test_a_queue_that_dips_restarts_the_delay():
    p = policy()
    assert p.decide(7, 1, now=0.0) is None
    assert p.decide(0, 1, now=5.0) is None  # back under: the clock stops
    assert p.decide(7, 1, now=6.0) is None
    assert p.decide(7, 1, now=15.0) is None
    assert p.decide(7, 1, now=16.0).replicas == 4


def test_a_scale_down_is_one_replica_at_a_time_after_its_delay():
    p = policy()
    assert p.decide(0, 3, now=0.0) is None
    assert p.decide(0, 3, now=59.0) is None
    assert p.decide(0, 3, now=60.0).replicas == 2
    assert p.decide(0, 2, now=61.0) is None  # the next one waits a whole delay again
    assert p.decide(0, 2, now=121.0).replicas == 1
    assert p.decide(0, 1, now=500.0) is None  # at min


def test_a_replica_lost_below_min_is_replaced_at_once():
    p = policy(min_replicas=2)
    decision = p.decide(0, 1, now=0.0)
    assert decision.replicas == 2 and "below min_replicas" in decision.reason


def test_the_config_refuses_bounds_out_of_order_and_a_start_count_outside_them():
    with pytest.raises(ValueError, match="min_replicas 3 > max_replicas 2"):
        AutoscalingConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match=r"replicas 1: the count at start must lie in autoscaling's \[2, 3\]"):
        ServerConfig(replicas=1, autoscaling=AutoscalingConfig(min_replicas=2, max_replicas=3))


def test_a_drained_replica_finishes_its_stream_and_takes_no_new_one(tiny_models, prompts, references):
    """RouterServer.drain: the replica's running stream ends as the target alone's; meanwhile every new request goes
    to the other replica; then the replica is gone from the router. add_replica brings one back that serves."""
    import asyncio

    from blockspec.protos import api_pb2
    from blockspec.services.engine.engine import Engine
    from tests.helpers import RouterThread, collect, slow_steps

    def engine():
        e = Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2)
        slow_steps(0.05)(e)
        return e

    r = RouterThread(engine(), replicas=(engine(),))
    try:
        first, second = r.router.schedulers
        live = r.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[3]), max_tokens=64),
                               timeout=120)
        head = next(live)
        busy = first if first.load else second
        other = second if busy is first else first
        drained = asyncio.run_coroutine_threadsafe(r.router.drain(busy), r.loop)
        for i in (4, 5):
            ids, _, _ = collect(r.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[i]),
                                                                        max_tokens=16), timeout=120))
            assert ids == references["qwen3"][i][:16]
        assert busy.load == 1 and not drained.done()  # still finishing its stream
        ids, _, finish = collect(live)
        assert list(head.token_ids) + ids == references["qwen3"][3][:64] and finish.reason in ("length", "stop")
        drained.result(60)
        assert r.router.schedulers == [other] and not r.router.draining
        added = asyncio.run_coroutine_threadsafe(r.router.add_replica(engine().loop), r.loop).result(60)
        assert added.replica == str(int(other.replica) + 1) and len(r.router.schedulers) == 2
    finally:
        r.close()


def test_a_replica_whose_step_found_a_role_gone_takes_no_new_request(tiny_models, prompts, references):
    """Scheduler.lost: from the step that found a role gone until LOST_HOLD_S later, new requests go to the other
    replica (before the supervisor's check notices the process)."""
    import time

    from blockspec.protos import api_pb2
    from blockspec.services.engine.engine import Engine
    from blockspec.services.router import scheduler as scheduler_module
    from tests.helpers import RouterThread, collect

    def engine():
        return Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2)

    r = RouterThread(engine(), replicas=(engine(),))
    try:
        first, second = r.router.schedulers
        first.lost_at = time.monotonic()
        before = first.steps
        for i in range(4):
            ids, _, _ = collect(r.stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[i]),
                                                                        max_tokens=8), timeout=120))
            assert ids == references["qwen3"][i][:8]
        assert first.steps == before and second.steps > 0
        first.lost_at -= scheduler_module.LOST_HOLD_S  # the hold over: it is in the rotation again
        assert not first.lost
    finally:
        r.close()
