"""Process memory as the roles report it with every op."""

from __future__ import annotations

import types

from blockspec.common.telemetry import metrics
from blockspec.common.telemetry.metrics import process_memory


def test_process_memory_is_read_again_only_when_older_than_asked(monkeypatch):
    rss, gpu = process_memory()
    assert rss > 0 and gpu >= 0  # a real reading
    readings = iter((100, 200))  # then the process's resident bytes as psutil would read them in turn
    monkeypatch.setattr(metrics.psutil, "Process",
                        lambda: types.SimpleNamespace(memory_info=lambda: types.SimpleNamespace(rss=next(readings))))
    assert process_memory() == (100, gpu)
    assert process_memory(max_age_s=3600.0) == (100, gpu)  # the last reading: recent enough
    assert process_memory() == (200, gpu)  # read again


def test_a_versions_series_are_dropped_with_it_and_the_others_stay():
    from prometheus_client import CollectorRegistry

    from blockspec.common.telemetry.metrics import RouterMetrics

    registry = CollectorRegistry()
    blue = RouterMetrics(registry, version="blue")
    green = blue.at("green")
    for metrics in (blue, green):
        metrics.steps.inc()
        metrics.requests_running.labels(replica="0").set(2)
        metrics.requests_finished.labels(reason="length").inc()
    green.drop()
    text = "\n".join(f"{s.name} {s.labels}" for m in registry.collect() for s in m.samples)
    assert "'green'" not in text and text.count("'blue'") >= 3
