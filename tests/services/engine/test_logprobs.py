"""Log-probabilities of generated tokens: the same bits with and without speculation at any k (the CPU kernels' rows do
not depend on the forward's width: a target of hidden size 256, whose projections they take), and transformers' own
log_softmax of the target's logits."""

from __future__ import annotations

import pytest
import torch

from blockspec.common.sampling import SamplingParams
from blockspec.services.engine.engine import Engine
from blockspec.services.router.step_loop import FinishEvent, TokenEvent

NEW = 24
TOP = 5


def generate(engine: Engine, prompts: list[list[int]], k: int, params: SamplingParams):
    """{request id: (generated tokens, their logprobs as tensors [n], top ids [n, TOP], top logprobs [n, TOP])}, and
    the tokens committed per step."""
    requests = [engine.request(f"r{i}", p, NEW, k=k, sampling=params) for i, p in enumerate(prompts)]
    tokens, logprobs, tau = {}, {}, []
    for event in engine.generate(requests):
        if isinstance(event, TokenEvent):
            assert len(event.logprobs) == len(event.token_ids)
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            logprobs.setdefault(event.request_id, []).extend(event.logprobs)
        elif isinstance(event, FinishEvent):
            tau.append(event.stats.tau)
    out = {r: (tokens[r], torch.tensor([lp.logprob for lp in lps]), torch.tensor([lp.top_ids for lp in lps]),
               torch.tensor([lp.top_logprobs for lp in lps])) for r, lps in logprobs.items()}
    return out, max(tau)


def assert_same_bits(got, want) -> None:
    assert got.keys() == want.keys()
    for r in want:
        assert got[r][0] == want[r][0], r
        for a, b in zip(got[r][1:], want[r][1:]):
            assert torch.equal(a, b), r


@pytest.fixture(scope="module")
def pair(tokenizer, tmp_path_factory):
    """A Qwen3 target of hidden size 256 and a random dflash drafter for it."""
    from blockspec.services.training.tiny import build_tiny_checkpoint, build_tiny_drafter

    root = tmp_path_factory.mktemp("lp")
    target = build_tiny_checkpoint(root / "qwen3", "qwen3", hidden_size=256, tokenizer=tokenizer)
    return target, build_tiny_drafter(root / "dflash", target)


@pytest.mark.parametrize("params", [SamplingParams(logprobs=TOP),
                                    SamplingParams(temperature=0.8, rule="strict", seed=7, repetition_penalty=1.3,
                                                   logprobs=TOP)])
def test_logprobs_are_the_same_bits_with_and_without_speculation(pair, prompts, params):
    target, drafter = pair
    plain, _ = generate(Engine(target, None, "none", max_batch=4), prompts[:3], 0, params)
    taus = []
    # The target drafting for itself accepts what a random target's near-uniform samples give no other drafter.
    for method, path, ks in (("ngram", None, (1, 3, 5)), ("dflash", drafter, (2, 4)), ("draft_model", target, (3,))):
        engine = Engine(target, path, method, max_batch=4)
        for k in ks:
            got, tau = generate(engine, prompts[:3], k, params)
            assert_same_bits(got, plain)
            taus.append(tau)
    assert max(taus) > 1.5, "no step committed several tokens: the test would not exercise speculation"


def test_logprobs_are_transformers_log_softmax(tiny_models, prompts):
    from transformers import AutoModelForCausalLM

    target = tiny_models["llama"]["target"]
    got, _ = generate(Engine(target, None, "ngram", max_batch=4), prompts[:2], 3, SamplingParams(logprobs=TOP))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts[:2]):
        tokens, logprobs, top_ids, top_logprobs = got[f"r{i}"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
        want = torch.log_softmax(logits.float(), dim=-1)  # [NEW, vocab]
        torch.testing.assert_close(logprobs, want.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(top_logprobs, want.gather(1, top_ids), atol=1e-5, rtol=0)
        torch.testing.assert_close(top_logprobs, want.topk(TOP).values, atol=1e-5, rtol=0)


def test_no_logprobs_unless_asked(tiny_models, prompts):
    engine = Engine(tiny_models["qwen3"]["target"], None, "ngram", max_batch=4)
    events = [e for e in engine.generate([engine.request("r", prompts[0], 8, k=3)]) if isinstance(e, TokenEvent)]
    assert events and all(e.logprobs == () for e in events)


def test_zero_top_logprobs_gives_each_tokens_own(tiny_models, prompts):
    engine = Engine(tiny_models["qwen3"]["target"], None, "ngram", max_batch=4)
    got, _ = generate(engine, prompts[:1], 3, SamplingParams(logprobs=0))
    assert got["r0"][2].shape == (NEW, 0) and bool((got["r0"][1] <= 0).all())


def test_a_draft_trees_logprobs_are_its_accepted_branchs_rows(pair, prompts):
    """A tree whose second child of the anchor and that child's child are the target's tokens: the committed tokens'
    log-probabilities come from the rows of that branch, the same bits as plain decoding's."""
    from blockspec.common.contracts import Draft, DraftTree, VerifyInput
    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.verifier.verifier import Verifier

    target, _ = pair
    params = SamplingParams(logprobs=TOP)
    plain, _ = generate(Engine(target, None, "none", max_batch=1), prompts[3:4], 0, params)
    tokens, logprobs, top_ids, _ = plain["r0"]
    verifier = Verifier(load_checkpoint(target), num_slots=1, max_len=256)
    verifier.add("r", prompts[3], params)
    (first,) = verifier.prefill(["r"])
    wrong = (tokens[1] + 1) % verifier.runner.config.vocab_size
    tree = DraftTree((wrong, tokens[1], tokens[2], tokens[2]), (-1, -1, 0, 1))  # [anchor's children, their children]
    (result,) = verifier.verify([VerifyInput("r", Draft((wrong, tokens[2]), tree=tree))])
    assert first.token_ids == (tokens[0],) and result.token_ids == tuple(tokens[1:4])
    got = first.logprobs + result.logprobs
    assert torch.equal(torch.tensor([lp.logprob for lp in got]), logprobs[:4])
    assert torch.equal(torch.tensor([lp.top_ids for lp in got]), top_ids[:4])
