"""The scheduler between the event loop and the step thread: streams keyed apart from their request ids."""

from __future__ import annotations

import asyncio

from blockspec.services.engine import Engine
from blockspec.services.router.scheduler import Scheduler
from blockspec.services.router.step_loop import FinishEvent


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
