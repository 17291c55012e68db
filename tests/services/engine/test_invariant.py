"""The invariant: speculative greedy output equals the target alone (transformers generate), token for
token, for every method and k, one prompt at a time and all prompts batched together."""

from __future__ import annotations

import pytest
import torch

from blockspec.common.errors import InvalidArgument
from blockspec.services.drafter.dflash import draft_vocab
from blockspec.services.engine.engine import Engine
from blockspec.services.router.adaptive_k import WARMUP_STEPS
from blockspec.services.router.step_loop import FinishEvent
from tests.helpers import DRAFT_VOCAB_SIZE, NEW_TOKENS

FAMILIES = ("llama", "qwen2", "qwen3")
KS = (1, 3, 5, 8)
DFLASH_KS = (1, 3, 5, 7)  # the tiny drafters have block_size 8
REJECTING_TOKENS = 48
# method name in the test -> (engine method, which checkpoint drafts)
METHODS = {
    "none": ("none", None),
    "ngram": ("ngram", None),
    "draft_model_same": ("draft_model", "target"),  # a drafter that always agrees: all-accepted + bonus path
    "draft_model_other": ("draft_model", "other"),  # a different random model: rejections
    "dflash_random": ("dflash", "random"),  # random weights, every module perturbed from identity
}


def run(engine: Engine, prompts: list[list[int]], k: int | None, max_tokens: int = 128) -> dict[str, FinishEvent]:
    requests = [engine.request(f"r{i}", p, max_tokens, k) for i, p in enumerate(prompts)]
    return {e.request_id: e for e in engine.generate(requests) if isinstance(e, FinishEvent)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", METHODS)
def test_greedy_output_equals_target_alone(family, name, tiny_models, dflash_drafters, prompts, references):
    method, drafter_key = METHODS[name]
    drafter = dflash_drafters[f"{family}-{drafter_key}"] if method == "dflash" else tiny_models[family].get(drafter_key)
    check_lossless(Engine(tiny_models[family]["target"], drafter, method, max_batch=len(prompts)), name, prompts,
                   references[family])


def test_trained_dflash_equals_target_alone_and_accepts(tiny_models, dflash_drafters, prompts, references):
    engine = Engine(tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained"], "dflash", max_batch=len(prompts))
    check_lossless(engine, "dflash_trained", prompts, references["qwen3"])


def test_draft_vocabulary_keeps_output_identical(tiny_models, dflash_drafters, prompts, references, monkeypatch):
    """A draft vocabulary (128 of the 320 tokens) narrows what the drafter proposes, never what is committed:
    every draft token is in it, and the output equals the target alone, tokens outside it included."""
    engine = Engine(tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained-vocab"], "dflash", max_batch=len(prompts))
    vocab = set(engine.proposer.vocab_ids.tolist())
    assert len(vocab) == DRAFT_VOCAB_SIZE
    proposed = []
    propose = engine.proposer.propose
    monkeypatch.setattr(engine.proposer, "propose", lambda inputs: proposed.append(propose(inputs)) or proposed[-1])
    check_lossless(engine, "dflash_trained", prompts, references["qwen3"])
    drafted = {t for drafts in proposed for d in drafts for t in d.token_ids}
    assert drafted and drafted <= vocab
    assert any(t not in vocab for ref in references["qwen3"] for t in ref), "the target never left the draft vocabulary"
    monkeypatch.setenv(draft_vocab.ENV, "0")  # the ablation: the whole LM head
    assert Engine(tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained-vocab"], "dflash").proposer.vocab_ids is None


def check_lossless(engine: Engine, name: str, prompts: list[list[int]], expected: list[list[int]]) -> None:
    method = engine.method
    # A random draft model rejects nearly every draft and costs k of its forwards per committed token: its first
    # REJECTING_TOKENS tokens give every k dozens of rejections and rollbacks, at a fraction of the time.
    max_tokens = REJECTING_TOKENS if name.startswith("draft_model_other") else NEW_TOKENS
    expected = [e[:max_tokens] for e in expected]
    for k in (None,) if method == "none" else DFLASH_KS if method == "dflash" else KS:
        drafted = accepted = first_accepted = steps = 0
        # One prompt at a time, then all of them in one batch.
        for batch in [[i] for i in range(len(prompts))] + [list(range(len(prompts)))]:
            done = run(engine, [prompts[i] for i in batch], k, max_tokens)
            for j, i in enumerate(batch):
                event = done[f"r{j}"]
                assert list(event.token_ids) == expected[i], f"{name} k={k} prompt {i} batch {len(batch)}"
                drafted += event.stats.drafted
                accepted += event.stats.accepted
                first_accepted += (event.stats.accepted_per_pos or [0])[0]
                steps += event.stats.steps
        if method == "none":
            assert drafted == 0
        else:
            assert drafted > 0, f"{name} k={k} drafted nothing: inconclusive, not a pass"
        if name == "draft_model_same":
            assert accepted == drafted
        if name in ("draft_model_other", "dflash_random"):
            assert accepted < drafted
        if name == "dflash_trained":  # random drafters accept ~0%; distillation must buy real acceptance
            assert first_accepted > steps / 10, f"first draft accepted in {first_accepted} of {steps} steps at k={k}"


def test_keys_read_in_spans_keep_output_identical(tiny_models, dflash_drafters, prompts, references):
    """On CUDA the target and the drafter read their KV caches in spans of keys (the rest masked). The same
    here on the torch path (the CPU kernels off, so every attention reads key_span keys, spans of 8): the
    trained dflash drafter's output still equals the target alone."""
    from blockspec.common.kernels import cpu_kernels

    engine = Engine(tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained"], "dflash", max_batch=len(prompts))
    engine.verifier.runner.cache.key_step = engine.proposer.cache.key_step = 8
    cpu_kernels.set_enabled(False)
    try:
        check_lossless(engine, "dflash_trained", prompts, references["qwen3"])
    finally:
        cpu_kernels.set_enabled(True)


def test_invariant_mode_keeps_output_identical(tiny_models, prompts, references):
    """--invariant pads decode to the verify width; the output must not change."""
    engine = Engine(tiny_models["qwen2"]["target"], None, "ngram", max_batch=len(prompts), invariant=True)
    done = run(engine, prompts, k=5)
    assert [list(done[f"r{i}"].token_ids) for i in range(len(prompts))] == references["qwen2"]
    assert sum(e.stats.drafted for e in done.values()) > 0


@pytest.mark.parametrize(("method", "drafter_key"), [("dflash", "trained"), ("ngram", None), ("draft_model", "other")])
def test_adaptive_k_keeps_output_identical(method, drafter_key, tiny_models, dflash_drafters, prompts, references):
    """Adaptive k changes how much is drafted per step, never what is committed; batched and one by one."""
    dirs = tiny_models["qwen3"]
    drafter = dflash_drafters["qwen3-trained"] if method == "dflash" else dirs.get(drafter_key)
    engine = Engine(dirs["target"], drafter, method, max_batch=len(prompts), adaptive_k=True)
    for batch in ([0], [5], list(range(len(prompts)))):
        done = run(engine, [prompts[i] for i in batch], 7)
        assert [list(done[f"r{j}"].token_ids) for j in range(len(batch))] == [references["qwen3"][i] for i in batch]
    # Past the warm-up: the widths were chosen, not the requested k.
    assert engine.loop.adaptive.steps > WARMUP_STEPS and engine.loop.adaptive.costs.batch_sizes[0] == 1


@pytest.mark.parametrize(("method", "drafter_key"), [("dflash", "trained"), ("draft_model", "other")])
def test_bfloat16_invariant_mode_equals_plain_decoding_in_bfloat16(method, drafter_key, tiny_models, dflash_drafters,
                                                                   prompts):
    """--dtype bfloat16 (what a GPU runs): in invariant mode a decode and a verify run the same shapes, so the
    speculative output equals plain decoding of the same bf16 target, every k, one by one and batched. (In
    default mode bf16 products depend on the row count: README, Exactness.)"""
    dirs = tiny_models["qwen3"]
    drafter = dflash_drafters["qwen3-trained"] if method == "dflash" else dirs[drafter_key]
    plain = Engine(dirs["target"], None, "none", max_batch=len(prompts), invariant=True, dtype=torch.bfloat16)
    assert plain.verifier.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    done = run(plain, prompts, None)
    expected = [list(done[f"r{i}"].token_ids) for i in range(len(prompts))]
    engine = Engine(dirs["target"], drafter, method, max_batch=len(prompts), invariant=True, dtype=torch.bfloat16)
    check_lossless(engine, f"{method}_{drafter_key}_bf16", prompts, expected)


@pytest.mark.parametrize(("method", "drafter_key"), [("dflash", "trained"), ("dflash", "random"), ("draft_model", "other")])
def test_prompt_lookup_keeps_output_identical(method, drafter_key, tiny_models, dflash_drafters, prompts, references,
                                              monkeypatch):
    """Prompt lookup drafts the requests whose context repeats, the drafter the others: the output is still the
    target alone's, one prompt at a time and batched, and both kinds of draft were verified."""
    dirs = tiny_models["qwen3"]
    drafter = dflash_drafters[f"qwen3-{drafter_key}"] if method == "dflash" else dirs[drafter_key]
    engine = Engine(dirs["target"], drafter, method, max_batch=len(prompts), prompt_lookup=True)
    looked_up, asked = [], []
    find, propose = engine.loop._looked_up, engine.proposer.propose
    monkeypatch.setattr(engine.loop, "_looked_up", lambda wants: looked_up.append(len(found := find(wants))) or found)
    monkeypatch.setattr(engine.proposer, "propose", lambda inputs: asked.append(len(inputs)) or propose(inputs))
    check_lossless(engine, f"{method}_{drafter_key}", prompts, references["qwen3"])
    assert sum(looked_up) > 0 and sum(asked) > 0, (sum(looked_up), sum(asked))


def test_adaptive_k_with_prompt_lookup_keeps_output_identical(tiny_models, dflash_drafters, prompts, references,
                                                              monkeypatch):
    """Adaptive k choosing the width with lookup's own rates for the looked-up requests: the output is still the
    target alone's, one prompt at a time and batched, past the warm-up, with both kinds of draft verified."""
    dirs = tiny_models["qwen3"]
    engine = Engine(dirs["target"], dflash_drafters["qwen3-trained"], "dflash", max_batch=len(prompts), adaptive_k=True,
                    prompt_lookup=True)
    looked_up = []
    find = engine.loop._looked_up
    monkeypatch.setattr(engine.loop, "_looked_up", lambda wants: looked_up.append(len(found := find(wants))) or found)
    for batch in ([0], [5], list(range(len(prompts)))):
        done = run(engine, [prompts[i] for i in batch], 7)
        assert [list(done[f"r{j}"].token_ids) for j in range(len(batch))] == [references["qwen3"][i] for i in batch]
    assert engine.loop.adaptive.steps > WARMUP_STEPS and sum(looked_up) > 0
    assert any(engine.loop.adaptive.lookup_prior.counts) and any(engine.loop.adaptive.prior.counts)


def test_longer_lookup_drafts_keep_output_identical(tiny_models, dflash_drafters, prompts, references):
    """prompt_lookup_tokens: a looked-up request drafts more tokens than the drafter's block (12 > 7); the output is
    still the target alone's, one prompt at a time and batched, and some steps did verify such a draft."""
    dirs = tiny_models["qwen3"]
    engine = Engine(dirs["target"], dflash_drafters["qwen3-trained"], "dflash", max_batch=len(prompts),
                    prompt_lookup=True, prompt_lookup_tokens=12)
    widest = []
    verify = engine.verifier.verify
    engine.loop.verifier.verify = lambda inputs: widest.append(max(len(i.draft.token_ids) for i in inputs)) or verify(inputs)
    for batch in ([0], [3], list(range(len(prompts)))):
        done = run(engine, [prompts[i] for i in batch], 3)
        assert [list(done[f"r{j}"].token_ids) for j in range(len(batch))] == [references["qwen3"][i] for i in batch]
    assert max(widest) == 12 and min(widest) <= 3, (max(widest), min(widest))
    with pytest.raises(InvalidArgument, match="prompt_lookup_tokens"):
        Engine(dirs["target"], dflash_drafters["qwen3-trained"], "dflash", invariant=True, prompt_lookup=True,
               prompt_lookup_tokens=12)
