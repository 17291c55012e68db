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
