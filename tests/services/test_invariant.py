"""The invariant: speculative greedy output equals the target alone (transformers generate), token for
token, for every method and k, one prompt at a time and all prompts batched together."""

from __future__ import annotations

import pytest

from blockspec.services.engine import Engine
from blockspec.services.router.step_loop import FinishEvent

FAMILIES = ("llama", "qwen2", "qwen3")
KS = (1, 3, 5, 8)
# method name in the test -> (engine method, which checkpoint drafts)
METHODS = {
    "none": ("none", None),
    "ngram": ("ngram", None),
    "draft_model_same": ("draft_model", "target"),  # a drafter that always agrees: all-accepted + bonus path
    "draft_model_other": ("draft_model", "other"),  # a different random model: rejections
}


def run(engine: Engine, prompts: list[list[int]], k: int | None, max_tokens: int = 128) -> dict[str, FinishEvent]:
    requests = [engine.request(f"r{i}", p, max_tokens, k) for i, p in enumerate(prompts)]
    return {e.request_id: e for e in engine.generate(requests) if isinstance(e, FinishEvent)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", METHODS)
def test_greedy_output_equals_target_alone(family, name, tiny_models, prompts, references):
    method, drafter_key = METHODS[name]
    drafter = tiny_models[family][drafter_key] if drafter_key else None
    engine = Engine(tiny_models[family]["target"], drafter, method, max_batch=len(prompts))
    expected = references[family]
    for k in KS if method != "none" else (None,):
        drafted = accepted = 0
        # One prompt at a time, then all of them in one batch.
        for batch in [[i] for i in range(len(prompts))] + [list(range(len(prompts)))]:
            done = run(engine, [prompts[i] for i in batch], k)
            for j, i in enumerate(batch):
                event = done[f"r{j}"]
                assert list(event.token_ids) == expected[i], f"{family} {name} k={k} prompt {i} batch {len(batch)}"
                drafted += event.stats.drafted
                accepted += event.stats.accepted
        if method == "none":
            assert drafted == 0
        else:
            assert drafted > 0, f"{name} k={k} drafted nothing: inconclusive, not a pass"
        if name == "draft_model_same":
            assert accepted == drafted
        if name == "draft_model_other":
            assert accepted < drafted


def test_invariant_mode_keeps_output_identical(tiny_models, prompts, references):
    """--invariant pads decode to the verify width; the output must not change."""
    engine = Engine(tiny_models["qwen2"]["target"], None, "ngram", max_batch=len(prompts), invariant=True)
    done = run(engine, prompts, k=5)
    assert [list(done[f"r{i}"].token_ids) for i in range(len(prompts))] == references["qwen2"]
    assert sum(e.stats.drafted for e in done.values()) > 0
