"""Qwen3.5 hybrid targets (Gated DeltaNet + gated attention): both published layouts load, every method's greedy output
equals transformers `generate` of the target alone (one prompt and batched, chunked prefill, k 1, 5, 15), and the
linear layers' states roll back to exactly what the committed tokens give."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from blockspec.common.models import load_checkpoint
from blockspec.common.runner import Runner, Segment
from blockspec.services.build.tiny import build_tiny_drafter, build_tiny_hybrid
from blockspec.services.serving.engine import Engine
from tests.conftest import hf_greedy

NEW = 48  # tokens generated per prompt
LAYOUTS = ("text", "multimodal")


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory, tokenizer) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hybrid")
    return {layout: build_tiny_hybrid(root / layout, layout, tokenizer=tokenizer) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def hybrid_prompts(prompts) -> list[list[int]]:
    return [prompts[2], prompts[4], prompts[6]]  # 7, 33 and 100 tokens


@pytest.fixture(scope="module")
def hybrid_references(hybrids, hybrid_prompts) -> dict[str, list[list[int]]]:
    return {layout: [hf_greedy(path, p, NEW) for p in hybrid_prompts] for layout, path in hybrids.items()}


@pytest.fixture(scope="module")
def hybrid_drafter(hybrids, tmp_path_factory):
    """A random DFlash-2 drafter tapping a linear-attention layer and the full-attention layer."""
    return build_tiny_drafter(tmp_path_factory.mktemp("hybrid-drafter") / "d", hybrids["text"], block_size=16,
                              target_layer_ids=(1, 3))


def test_both_layouts_read_the_layer_types_and_the_text_weights(hybrids, caplog):
    with caplog.at_level(logging.INFO, logger="blockspec.common.models"):
        checkpoints = {layout: load_checkpoint(path) for layout, path in hybrids.items()}
    cfg = checkpoints["text"].config
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.attention_layers == (3,) and cfg.linear_layers == (0, 1, 2)
    assert (cfg.rotary_dim, cfg.head_dim, cfg.linear.num_v_heads, cfg.linear.conv_dim) == (8, 32, 6, 2 * 32 + 96)
    assert checkpoints["multimodal"].config == dataclasses.replace(cfg, family="qwen3_5")
    assert set(checkpoints["multimodal"].weights) == set(checkpoints["text"].weights)
    assert "under model.visual. left unread" in caplog.text
    raw = json.loads((hybrids["multimodal"] / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and "vision_config" in raw


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("method", "k"), [("none", None), ("ngram", 1), ("ngram", 5), ("ngram", 15), ("dflash", 1),
                                           ("dflash", 5), ("dflash", 15)])
def test_greedy_output_equals_the_target_alone(hybrids, hybrid_drafter, hybrid_prompts, hybrid_references, layout,
                                               method, k):
    """Three prompts of different lengths batched, prefilled 16 tokens per step (chunked), and each one alone."""
    drafter = hybrid_drafter if method == "dflash" else None
    engine = Engine(hybrids[layout], drafter, method, max_batch=3, prefill_chunk=16, threads=1)
    done = engine.complete([engine.request(str(i), p, NEW, k) for i, p in enumerate(hybrid_prompts)])
    assert [list(d.token_ids) for d in done] == hybrid_references[layout]
    alone = engine.complete([engine.request("alone", hybrid_prompts[1], NEW, k)])
    assert list(alone[0].token_ids) == hybrid_references[layout][1]
    if k:
        assert sum(d.stats.drafted for d in done) > 0


def _states(runner: Runner, slot: int) -> list[torch.Tensor]:
    """The slot's current conv and recurrent state of every linear layer."""
    states = runner.cache.states
    cur = states.current[slot]
    return [states.conv[:, slot, cur].clone(), states.recurrent[:, slot, cur].clone()]


@pytest.mark.parametrize("rollback", ["replay", "states"])
@pytest.mark.parametrize("k", [5, 15])
def test_a_rolled_back_verify_leaves_the_state_of_the_committed_tokens(hybrids, hybrid_prompts, rollback, k):
    """For every accepted length j in 0..k the linear layers' state equals a fresh prefill of the prompt and the
    anchor + j drafts. Within 2e-6 relative, not bitwise: the fresh prefill runs the projections over other row
    counts, whose fp32 sums round differently; the replay itself is the verify's arithmetic, token for token."""
    ck = load_checkpoint(hybrids["text"])
    runner = Runner(ck, num_slots=2, max_len=256)
    runner.cache.states.rollback = rollback
    prompt, block = hybrid_prompts[1], [(37 * i + 11) % 300 + 2 for i in range(k + 1)]  # anchor + k drafts
    slot = runner.cache.allocate()
    runner.forward([Segment(slot, prompt, last_only=True)])
    runner.forward([Segment(slot, block)])
    for j in [*range(k + 1), 0]:  # back to j = 0 after the longest: any order reaches every length
        runner.cache.set_length(slot, len(prompt) + j + 1)
        got = _states(runner, slot)
        fresh = Runner(ck, num_slots=1, max_len=256)
        fresh_slot = fresh.cache.allocate()
        fresh.forward([Segment(fresh_slot, prompt + block[: j + 1], last_only=True)])
        for a, b in zip(got, _states(fresh, fresh_slot)):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_replayed_and_kept_states_are_the_same_bits(hybrids, hybrid_prompts):
    ck = load_checkpoint(hybrids["text"])
    block = [(53 * i + 5) % 300 + 2 for i in range(6)]
    got = {}
    for rollback in ("replay", "states"):
        runner = Runner(ck, num_slots=2, max_len=256)
        runner.cache.states.rollback = rollback
        slots = [runner.cache.allocate(), runner.cache.allocate()]
        runner.forward([Segment(s, hybrid_prompts[i], last_only=True) for i, s in enumerate(slots)])
        runner.forward([Segment(s, block[: 6 - i]) for i, s in enumerate(slots)])  # batched, padded
        got[rollback] = []
        for j in (0, 2, 4):
            for s in slots:
                runner.cache.set_length(s, len(hybrid_prompts[slots.index(s)]) + j + 1)
                got[rollback] += _states(runner, s)
    assert all(torch.equal(a, b) for a, b in zip(got["replay"], got["states"]))


def test_a_prompt_prefilled_in_chunks_leaves_the_state_of_one_pass(hybrids, hybrid_prompts):
    ck = load_checkpoint(hybrids["text"])
    prompt, states = hybrid_prompts[2], []
    for chunk in (len(hybrid_prompts[2]), 7):
        runner = Runner(ck, num_slots=1, max_len=256)
        slot = runner.cache.allocate()
        for i in range(0, len(prompt), chunk):
            runner.forward([Segment(slot, prompt[i : i + chunk], last_only=True)])
        states.append(_states(runner, slot))
    for a, b in zip(*states):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_a_rollback_outside_the_last_forward_is_refused(hybrids, hybrid_prompts):
    runner = Runner(load_checkpoint(hybrids["text"]), num_slots=1, max_len=256)
    slot = runner.cache.allocate()
    runner.forward([Segment(slot, hybrid_prompts[1], last_only=True)])
    runner.forward([Segment(slot, [5, 6, 7])])
    with pytest.raises(ValueError, match="linear-attention state holds positions 33..36 of its last forward, not 20"):
        runner.cache.set_length(slot, 20)
