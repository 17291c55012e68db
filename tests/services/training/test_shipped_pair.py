"""The default pair shipped in models/base: its card's promises, and lossless generation on held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockspec.services.engine.engine import Engine
from blockspec.services.router.step_loop import FinishEvent
from tests.helpers import hf_greedy

PAIR = Path(__file__).resolve().parents[3] / "models" / "base"
pytestmark = pytest.mark.skipif(not (PAIR / "card.json").is_file(), reason="models/base is not built (build-default)")


def heldout_prompts(tokenizer, n: int = 4) -> list[list[int]]:
    lines = (PAIR / "heldout_prompts.jsonl").read_text().splitlines()
    return [tokenizer.encode(json.loads(line)) for line in lines[:n]]


def test_card_keeps_the_size_promises():
    card = json.loads((PAIR / "card.json").read_text())
    # Our budget for the drafter's own weights (the published DFlash-2 drafter is ~7% of its target).
    assert card["drafter_share_of_target"] <= 0.25
    from safetensors import safe_open

    with safe_open(str(PAIR / "drafter" / "model.safetensors"), framework="pt") as f:
        assert not any("embed" in k or "lm_head" in k for k in f.keys())
    # The card was measured with the drafter's draft vocabulary: half the vocabulary, end-of-sequence in it.
    from blockspec.services.drafter.dflash import draft_vocab

    ids = draft_vocab.load(PAIR / "drafter", card["draft_vocab"]["vocab_size"])
    assert len(ids) == card["draft_vocab"]["size"] == card["draft_vocab"]["vocab_size"] // 2 and int(ids[0]) == 0


@pytest.mark.parametrize("drafter", ["drafter", "drafter-sampled"])
def test_dflash_on_the_shipped_pair_equals_the_target_alone(drafter):
    engine = Engine(PAIR / "target", PAIR / drafter, "dflash", max_batch=4)
    assert engine.proposer.vocab_ids is not None  # the shipped draft vocabulary is in use
    prompts = heldout_prompts(engine.tokenizer)
    expected = [hf_greedy(PAIR / "target", p, 64) for p in prompts]
    for k in (3, 5, 7):
        for batch in ([[i] for i in range(len(prompts))] + [list(range(len(prompts)))]):
            done = {e.request_id: e for e in engine.generate([engine.request(str(i), prompts[i], 64, k) for i in batch])
                    if isinstance(e, FinishEvent)}
            for i in batch:
                assert list(done[str(i)].token_ids) == expected[i], f"k={k} prompt {i}"
                assert done[str(i)].stats.drafted > 0


@pytest.mark.skipif(not (PAIR / "assistant" / "config.json").is_file(), reason="no shipped assistant (build-assistant)")
def test_draft_model_with_the_shipped_assistant_equals_the_target_alone():
    card = json.loads((PAIR / "card.json").read_text())
    assert card["assistant_parameters"] <= 0.25 * card["target_parameters"]
    engine = Engine(PAIR / "target", PAIR / "assistant", "draft_model", max_batch=2)
    prompts = heldout_prompts(engine.tokenizer, 2)
    expected = [hf_greedy(PAIR / "target", p, 64) for p in prompts]
    done = {e.request_id: e for e in engine.generate([engine.request(str(i), p, 64, 3) for i, p in enumerate(prompts)])
            if isinstance(e, FinishEvent)}
    for i in range(len(prompts)):
        assert list(done[str(i)].token_ids) == expected[i], f"prompt {i}"
    assert sum(done[str(i)].stats.accepted for i in range(len(prompts))) > 0
