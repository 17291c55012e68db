"""The step loop as a server drives it: requests join between steps, cancellation frees both roles' slots."""

from __future__ import annotations

import dataclasses

import pytest

from blockspec.services.engine.engine import Engine
from blockspec.services.router.step_loop import FinishEvent, TokenEvent
from tests.helpers import NEW_TOKENS


def test_requests_join_between_steps_and_stay_exact(tiny_models, prompts, references):
    engine = Engine(tiny_models["llama"]["target"], tiny_models["llama"]["other"], "draft_model", max_batch=4)
    loop, tokens, done = engine.loop, {}, {}
    loop.submit(engine.request("a", prompts[2], 128, 3))
    for _ in range(5):
        for e in loop.step():
            tokens.setdefault(e.request_id, []).extend(e.token_ids if isinstance(e, TokenEvent) else [])
    loop.submit(engine.request("b", prompts[5], 128, 5))  # joins a running batch
    while not loop.idle:
        for e in loop.step():
            if isinstance(e, TokenEvent):
                tokens.setdefault(e.request_id, []).extend(e.token_ids)
            else:
                done[e.request_id] = e
    assert list(done["a"].token_ids) == tokens["a"] == references["llama"][2]
    assert list(done["b"].token_ids) == tokens["b"] == references["llama"][5]


def test_a_request_waiting_for_a_slot_counts_the_wait_apart(tiny_models, prompts):
    """queued_s: submitted -> admitted. The bench's TTFT starts at admission, so a request queued behind another
    at concurrency 1 is not charged that request's whole run."""
    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=1)
    done = {e.request_id: e for e in engine.generate([engine.request(r, prompts[1], 96, 0) for r in ("a", "b")])
            if isinstance(e, FinishEvent)}
    a, b = done["a"].stats, done["b"].stats
    assert a.queued_s < a.first_token_s < a.elapsed_s
    assert b.started + b.queued_s >= a.started + a.elapsed_s  # admitted once a had finished
    assert b.queued_s < b.first_token_s < b.elapsed_s
    assert b.first_token_s - b.queued_s < a.elapsed_s  # its own prefill (about 1 ms), not a's run of 96 tokens


def test_cancel_frees_slots_in_both_roles(tiny_models, prompts):
    engine = Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2)
    loop = engine.loop
    free_verifier, free_drafter = engine.verifier.free_slots, engine.proposer.runner.cache.free_slots
    for i in range(2):
        loop.submit(engine.request(f"r{i}", prompts[3], 64, 4))
    loop.submit(engine.request("queued", prompts[3], 64, 4))
    loop.step()
    loop.step()
    assert engine.verifier.free_slots == free_verifier - 2
    events = [loop.cancel(rid) for rid in ("r0", "r1", "queued")]
    assert all(isinstance(e, FinishEvent) and e.reason == "cancelled" for e in events)
    assert loop.idle and loop.cancel("r0") is None
    assert engine.verifier.free_slots == free_verifier
    assert engine.proposer.runner.cache.free_slots == free_drafter


def test_chunked_prefill_keeps_running_streams_going(tiny_models, prompts, references):
    """A 150-token prompt arriving mid-stream is prefilled 32 tokens per step; the running request gets
    tokens at every one of those steps, and both outputs equal the target alone."""
    from blockspec.services.engine.engine import Engine
    from blockspec.services.router.step_loop import FinishEvent, TokenEvent

    engine = Engine(tiny_models["qwen3"]["target"], None, "ngram", max_batch=2, prefill_chunk=32)
    loop = engine.loop
    loop.submit(engine.request("short", prompts[2], 128, 3))
    events = loop.step() + loop.step()
    loop.submit(engine.request("long", prompts[7], 40, 3))  # 150 tokens: 5 steps of prefill at 32 per step
    steps_while_prefilling = 0
    while loop.num_waiting:
        step_events = loop.step()
        events += step_events
        steps_while_prefilling += 1
        if loop.num_waiting:
            assert any(isinstance(e, TokenEvent) and e.request_id == "short" for e in step_events), "stalled"
            load = loop.load  # a prompt part-prefilled holds its slot, and the blocks of its part
            assert (load.running, load.waiting, load.slots) == (1, 1, 2) and 0 < load.kv_usage < 1
    assert steps_while_prefilling == 5
    while not loop.idle:
        events += loop.step()
    done = {e.request_id: list(e.token_ids) for e in events if isinstance(e, FinishEvent)}
    assert done["short"] == references["qwen3"][2]
    assert done["long"] == references["qwen3"][7][:40]


def test_adaptive_k_is_told_which_steps_the_drafter_caught_up_on(tiny_models, prompts):
    """The first drafting step of a request (its whole prompt for the drafter to catch up) is flagged, so
    adaptive k does not take its time for the drafter's usual one; the steps after it are not."""
    engine = Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2,
                    adaptive_k=True)
    loop, flags = engine.loop, []
    observe = loop.adaptive.observe_step
    loop.adaptive.observe_step = lambda *args, **kw: (flags.append(args[-1]), observe(*args, **kw))
    loop.submit(engine.request("a", prompts[2], 24, 3))
    for _ in range(4):
        loop.step()
    loop.submit(engine.request("b", prompts[5], 24, 3))  # joins: the step after its prefill catches up
    while not loop.idle:
        loop.step()
    assert flags[:4] == [True, False, False, False]
    assert flags[4] is True and flags.count(True) == 2


def test_prompt_lookup_drafts_repeats_and_asks_the_drafter_for_the_rest(tiny_models, dflash_drafters, prompts,
                                                                        references):
    """Each request-step is drafted by exactly one of the two: lookup where the context's suffix occurred before
    (the drafter never sees those), the drafter elsewhere; the stats, the step reports and the output agree."""
    from blockspec.common.tokens.lookup import lookup
    from blockspec.services.router.step_loop import LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM

    engine = Engine(tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained"], "dflash", max_batch=4,
                    prompt_lookup=True)
    loop, asked, reports, done = engine.loop, [], [], {}
    propose = engine.proposer.propose
    # the committed tokens as each request stood when asked (the loop extends the same list afterwards)
    engine.proposer.propose = lambda inputs: asked.extend((tuple(i.token_ids), i.k) for i in inputs) or propose(inputs)
    for i in range(4):
        loop.submit(engine.request(f"r{i}", prompts[i], NEW_TOKENS, 5))
    while not loop.idle:
        done.update((e.request_id, e) for e in loop.step() if isinstance(e, FinishEvent))
        reports += [loop.last_report] if loop.last_report else []
    assert [list(done[f"r{i}"].token_ids) for i in range(4)] == references["qwen3"][:4]
    assert asked and all(lookup(ids, k, LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM, periodic=True) == () for ids, k in asked)
    looked_up = sum(e.stats.looked_up for e in done.values())
    assert looked_up == sum(r.looked_up for r in reports) > 0
    # every request-step with a draft came from one source: the last step of a request may ask for none (k = 0)
    drafting_steps = sum(r.drafts for r in reports)
    assert looked_up + len(asked) >= drafting_steps > sum(e.stats.steps for e in done.values()) - 8


def test_step_spans_only_while_a_tracer_provider_is_set(tiny_models, prompts, monkeypatch):
    """No provider set (no OTLP endpoint): spans would be no-ops, and the loop makes none. Once one is set, every
    step gets its span with the step's figures (the served path: tests/services/serving/test_observability.py)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from blockspec.common.telemetry import tracing

    made = []
    step_span = tracing.step_span
    monkeypatch.setattr(tracing, "step_span", lambda parents: made.append(parents) or step_span(parents))
    engine = Engine(tiny_models["qwen3"]["target"], None, "ngram", max_batch=1)

    def steps() -> int:
        done = [e for e in engine.generate([engine.request("r", prompts[2], 40, 3)]) if isinstance(e, FinishEvent)]
        return done[0].stats.steps

    assert not tracing.recording()
    assert steps() > 0 and made == []
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    assert tracing.recording()
    n = steps()
    spans = [s for s in exporter.get_finished_spans() if s.name == tracing.SPAN_STEP]
    assert len(made) == len(spans) == n
    assert sum(s.attributes[tracing.ATTR_DRAFTED] for s in spans) >= sum(s.attributes[tracing.ATTR_ACCEPTED] for s in spans) > 0


def test_a_step_that_fails_midway_still_ends_the_requests_it_finished(tiny_models, prompts):
    """Two requests finish at their first token in one step; releasing the second fails. The first's finish was
    made before the failure and the second is still held: cancel_all ends both (nothing waits forever)."""
    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=2)
    release = engine.verifier.release

    def failing_release(request_id):
        if request_id == "b":
            raise RuntimeError("injected: release")
        release(request_id)

    engine.verifier.release = failing_release
    for rid in ("a", "b"):
        engine.loop.submit(engine.request(rid, prompts[1], 1, 0))
    with pytest.raises(RuntimeError, match="injected"):
        engine.loop.step()
    ended = {e.request_id for e in engine.loop.cancel_all()}
    assert ended == {"a", "b"} and engine.loop.idle


def test_a_verifier_that_committed_other_tokens_fails_the_step(tiny_models, prompts):
    """The step loop's committed tokens and the verifier's must agree; a result that says otherwise is not streamed."""
    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=1)
    verify = engine.verifier.verify

    def verify_one_off(inputs):
        return [dataclasses.replace(r, committed_len=r.committed_len + 1) for r in verify(inputs)]

    engine.verifier.verify = verify_one_off
    engine.loop.submit(engine.request("a", prompts[1], 8, 0))
    with pytest.raises(RuntimeError, match="the verifier committed"):
        engine.loop.step()  # the prefill's result holds; the decode's does not


def test_a_round_that_fails_still_ends_the_requests_its_prefill_finished(tiny_models, prompts):
    """step() without emit hands a step's first tokens on with its round's events. Here request "a" finishes at its
    first token and the round of "b" fails: cancel_all still ends both."""
    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=2)

    def failing_verify(inputs):
        raise RuntimeError("injected: verify")

    engine.verifier.verify = failing_verify
    engine.loop.submit(engine.request("a", prompts[1], 1, 0))
    engine.loop.submit(engine.request("b", prompts[2], 8, 0))
    with pytest.raises(RuntimeError, match="injected"):
        engine.loop.step()
    assert {e.request_id for e in engine.loop.cancel_all()} == {"a", "b"} and engine.loop.idle
