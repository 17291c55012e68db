"""The scheduler between the event loop and the step thread: streams keyed apart from their request ids."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from blockspec.common.telemetry.metrics import DEFAULT_VERSION, RouterMetrics
from blockspec.services.engine.engine import Engine
from blockspec.services.router.scheduler import Scheduler
from blockspec.services.router.step_loop import FinishEvent, TokenEvent

AT = {"version": DEFAULT_VERSION}  # every router metric carries its serving version


def test_a_finished_streams_late_cancel_leaves_the_next_stream_under_its_id_alone(tiny_models, prompts, references):
    """Stream A finishes; before its handler gets to its own clean-up, stream B takes the same request_id. A's late
    cancel (its client gone, or a stop sequence) must reach A's request only: B runs to its end."""
    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=2)

    async def events_of(stream) -> list:
        events = []
        while not events or not isinstance(events[-1], FinishEvent):
            events.append(await asyncio.wait_for(stream.events.get(), 30))
        return events

    async def run():
        scheduler = Scheduler(engine.loop)
        await scheduler.start()
        try:
            a = await scheduler.submit(engine.request("x", prompts[1], 2, 0))
            await events_of(a)
            b = await scheduler.submit(engine.request("x", prompts[2], 24, 0))
            assert await scheduler.cancel(a.key) is None  # A had finished: nothing of B's is touched
            return await events_of(b)
        finally:
            await scheduler.stop()

    finish = asyncio.run(run())[-1]
    assert finish.reason == "length" and list(finish.token_ids) == references["qwen3"][2][:24]


def test_the_kv_cache_usage_gauge_is_the_share_of_blocks_held(tiny_models, prompts):
    """blockspec_kv_cache_usage_perc (vLLM's name, 1 = full): the share of the KV cache's blocks the requests hold (two
    short requests: a block or two each). Back to 0 when the streams end (their blocks cached, free to take)."""
    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=4)
    registry = CollectorRegistry()

    def gauges() -> tuple[float, float, float]:
        return tuple(registry.get_sample_value(name, {"replica": "0", **AT}) for name in (
            "blockspec_kv_slots_used", "blockspec_kv_cache_usage_perc", "blockspec_requests_running"))

    async def until(stream, kind) -> None:
        while not isinstance(await asyncio.wait_for(stream.events.get(), 30), kind):
            pass

    async def run():
        scheduler = Scheduler(engine.loop, RouterMetrics(registry))
        await scheduler.start()
        try:
            a = await scheduler.submit(engine.request("a", prompts[1], 24, 0))
            b = await scheduler.submit(engine.request("b", prompts[2], 24, 0))
            await until(b, TokenEvent)
            await until(b, TokenEvent)  # a step's events: its gauges were set before them
            during = gauges()
            await until(a, FinishEvent)
            await until(b, FinishEvent)
            for _ in range(100):
                if gauges()[0] == 0:
                    break
                await asyncio.sleep(0.05)
            return during, gauges()
        finally:
            await scheduler.stop()

    during, after = asyncio.run(run())
    assert during[0] == during[2] == 2 and 2 <= during[1] * engine.verifier.num_blocks <= 4
    assert after == (0, 0, 0)


def test_prefix_cache_and_preemption_counters(tiny_models, prompts):
    """blockspec_prefix_cache_queries / _hits count the prompt tokens looked up and found (the second of two equal
    prompts finds all its full blocks but the last token's); blockspec_num_preemptions counts the requests a cache of
    96 positions takes back from three that grow to 70 each."""
    registry = CollectorRegistry()

    def counters() -> tuple[float, float, float]:
        return tuple(registry.get_sample_value(f"blockspec_{name}_total", {"replica": "0", **AT}) or 0.0
                     for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"))

    async def serve(engine, waves) -> None:
        scheduler = Scheduler(engine.loop, RouterMetrics(registry))
        await scheduler.start()
        try:
            for requests in waves:  # each wave's requests together, once the last wave's have finished
                streams = [await scheduler.submit(r) for r in requests]
                for stream in streams:
                    while not isinstance(await asyncio.wait_for(stream.events.get(), 30), FinishEvent):
                        pass
            await asyncio.sleep(0.1)  # the last step's metrics
        finally:
            await scheduler.stop()

    prompt = prompts[6][:40]
    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=1)
    asyncio.run(serve(engine, [[engine.request(rid, prompt, 8, 0)] for rid in ("a", "b")]))
    assert counters()[:2] == (80, 32)
    registry = CollectorRegistry()
    small = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=3, max_len=96, kv_cache_tokens=96)
    asyncio.run(serve(small, [[small.request(f"r{i}", prompts[6][i : i + 30], 40, 0) for i in range(3)]]))
    assert counters()[2] == small.loop.preemptions > 0
