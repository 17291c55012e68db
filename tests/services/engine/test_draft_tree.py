"""Draft trees (`Engine(draft_tree=...)`): several candidates per position, verified in one forward, lossless under
every rule - greedy equal to the target alone, strict equal to plain decoding for a seed, rejection distributed as
the target's samples - and the settings that cannot take one refused by name."""

from __future__ import annotations

import pytest

from blockspec.common.errors import InvalidArgument
from blockspec.common.sampling import GREEDY, SamplingParams
from blockspec.services.engine.engine import Engine
from blockspec.services.router.step_loop import FinishEvent
from tests.helpers import P_FAIL, SAMPLES, chi_square_p, exact_cells, sample_sequences, with_sampling_top_k

TREES = [(2,), (3, 2), pytest.param((2, 2, 2), marks=pytest.mark.slow)]


def texts(engine: Engine, prompts: list[list[int]], k: int, max_tokens: int,
          params: SamplingParams | None = None) -> tuple[dict[str, tuple[int, ...]], float]:
    """Each prompt's generated ids (request i of seed s: params' rule at that seed) and the tau of the run."""
    seeds = [None] if params is None else range(8)
    requests = [engine.request(f"{s}-{i}", p, max_tokens, k, GREEDY if s is None else
                               SamplingParams(**{**vars(params), "seed": s}))
                for s in seeds for i, p in enumerate(prompts)]
    done = [e for e in engine.generate(requests) if isinstance(e, FinishEvent)]
    steps = sum(e.stats.steps for e in done)
    return {e.request_id: tuple(e.token_ids) for e in done}, 1 + sum(e.stats.accepted for e in done) / max(steps, 1)


@pytest.mark.parametrize("tree", TREES)
def test_greedy_draft_trees_equal_the_target_alone(tiny_models, dflash_drafters, prompts, references, tree):
    target = tiny_models["qwen3"]["target"]
    for k in (3, 5):
        engine = Engine(target, dflash_drafters["qwen3-trained"], "dflash", max_batch=4, draft_tree=tree)
        got, tau = texts(engine, prompts, k, len(references["qwen3"][0]))
        for i, reference in enumerate(references["qwen3"]):
            assert list(got[f"None-{i}"]) == reference[: len(got[f"None-{i}"])], (tree, k, i)
        assert tau > 1.0, "nothing was accepted: the test would not exercise the tree"


def test_a_tree_with_penalties_equals_transformers_generate(tiny_pair):
    """Each tree row is processed with its own path as the history (a repetition penalty sees the branch's tokens)."""
    from transformers import AutoTokenizer

    from tests.helpers import hf_greedy

    prompt = AutoTokenizer.from_pretrained(tiny_pair.target).encode("    def wrap(self, text):\n        ")
    engine = Engine(tiny_pair.target, tiny_pair.drafter, "dflash", max_batch=1, draft_tree=(3, 2))
    for settings in ({"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 3}):
        done = engine.complete([engine.request("0", prompt, 32, 4, SamplingParams(**settings))])[0]
        assert list(done.token_ids) == hf_greedy(tiny_pair.target, prompt, 32, **settings), settings
        assert done.stats.accepted > 0


def test_a_tree_near_the_end_of_the_context_is_cut_to_fit(tiny_models, dflash_drafters, prompts, references):
    """Requests that run to the last position of the cache: the tree's depth shrinks where its tokens would not fit."""
    target, prompt = tiny_models["qwen3"]["target"], prompts[0]
    new = len(references["qwen3"][0])
    engine = Engine(target, dflash_drafters["qwen3-trained"], "dflash", max_batch=1, max_len=len(prompt) + new,
                    draft_tree=(3, 3))
    got, _ = texts(engine, [prompt], 5, new)
    assert list(got["None-0"]) == references["qwen3"][0]


def test_a_wider_tree_accepts_more_and_one_child_per_node_is_the_path(tiny_pair):
    """On the trained tiny pair: tau grows with the tree; (1,) drafts and judges exactly what the path does (the torch
    walk, which the tree's walk follows), text for text under `rejection`."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_pair.target).encode("    def wrap(self, text):\n        ")
    params = SamplingParams(temperature=0.8, rule="rejection")
    taus, outputs = {}, {}
    for tree in ((), (1,), (3, 2)):
        engine = Engine(tiny_pair.target, tiny_pair.drafter, "dflash", max_batch=8, draft_tree=tree)
        engine.proposer._cpu = None  # the torch walk: the tree's own walk and the path's share its arithmetic
        outputs[tree], taus[tree] = texts(engine, [prompt], 4, 24, params)
    assert outputs[(1,)] == outputs[()] and taus[(1,)] == taus[()]
    assert taus[(3, 2)] > taus[()], taus


@pytest.mark.parametrize("tree", [(2,), (3, 2)])
def test_strict_draft_trees_give_plain_decodings_text(tiny_pair, tree):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_pair.target).encode("    def wrap(self, text):\n        ")
    params = SamplingParams(temperature=0.8, top_p=0.95, rule="strict")
    plain, _ = texts(Engine(tiny_pair.target, None, "none", max_batch=8), [prompt], 0, 24, params)
    got, tau = texts(Engine(tiny_pair.target, tiny_pair.drafter, "dflash", max_batch=8, draft_tree=tree), [prompt], 4,
                     24, params)
    assert got == plain and len(set(plain.values())) > 4
    assert tau > 1.0


@pytest.mark.parametrize(("tree", "temperature"), [((3, 2), 1.0), pytest.param((2, 2), 0.7, marks=pytest.mark.slow)])
def test_rejection_over_a_draft_tree_keeps_the_target_distribution(tiny_pair, tmp_path, tree, temperature):
    """10,000 sequences of 3 tokens against the target's exact probabilities (test_sampling's chi-square); the T 1.0
    tree's drafter draws from 64 candidates a slot (sampling_top_k; its greedy walk 16), the other's from 16."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_pair.target).encode("    def wrap(self, text):\n        ")
    params = SamplingParams(temperature=temperature, rule="rejection")
    cells = exact_cells(tiny_pair.target, prompt, params, 3, SAMPLES)
    drafter = tiny_pair.drafter if temperature != 1.0 else with_sampling_top_k(tiny_pair.drafter, 64, tmp_path / "d")
    engine = Engine(tiny_pair.target, drafter, "dflash", max_batch=512, max_len=len(prompt) + 16, draft_tree=tree)
    assert engine.proposer.cfg.sampling_width == (64 if temperature == 1.0 else 16)
    counts, acceptance = sample_sequences(engine, prompt, params, 3, 2, SAMPLES)
    p_value = chi_square_p(counts, cells, SAMPLES)
    assert p_value > P_FAIL, f"chi-square p = {p_value:.2e}: the output is not distributed as the target's samples"
    assert acceptance > 0.05, "drafts were (almost) never accepted: the test would not exercise the rule"


def test_settings_that_cannot_take_a_tree_are_refused_by_name(tiny_models, dflash_drafters, tmp_path, tokenizer):
    from blockspec.services.training.tiny import build_tiny_drafter, build_tiny_family

    target, drafter = tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained"]
    refused = {
        "children per node must be at least 1": {"draft_tree": (2, 0)},
        "with method dflash only, not ngram": {"method": "ngram", "drafter": None, "draft_tree": (2,)},
        "not allowed with invariant mode, adaptive k or prompt lookup": {"draft_tree": (2,), "adaptive_k": True},
    }
    for message, settings in refused.items():
        args = {"target": target, "drafter": drafter, "method": "dflash", "max_batch": 2, **settings}
        with pytest.raises(InvalidArgument, match=message) as err:
            Engine(**args)
        assert err.value.field == "draft_tree"
    hybrid = build_tiny_family(tmp_path / "hybrid", "qwen3_5", tokenizer=tokenizer)
    with pytest.raises(InvalidArgument, match="needs a target of attention layers only"):
        Engine(hybrid, build_tiny_drafter(tmp_path / "hybrid-drafter", hybrid), "dflash", max_batch=2, draft_tree=(2,))


def test_the_config_key_reaches_the_inprocess_engine_and_role_processes_refuse_it(tiny_models, dflash_drafters,
                                                                                  prompts, references):
    """model.spec_decode.draft_tree: `serve --inprocess` builds its engine with it; the role processes' plan (--no-ray,
    Ray, `blockspec plan`) refuses it naming the key; a count out of range is the config's own error."""
    import torch

    from blockspec.common.config import load_yaml, parse_config
    from blockspec.services.serving.inprocess import build_engine
    from blockspec.services.serving.startup import resolve_startup
    from tests.helpers import CONFIG

    text = CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
    raw = load_yaml(text, "config")
    raw["model"]["spec_decode"]["draft_tree"] = [3, 2]
    cfg = parse_config(raw)
    with pytest.raises(InvalidArgument, match=r"\[3, 2\]: a draft tree is verified by an engine in the server's "
                                              r"process: serve --inprocess") as err:
        resolve_startup(cfg)
    assert err.value.field == "model.spec_decode.draft_tree"
    engine = build_engine(cfg, resolve_startup(cfg, inprocess=True), "cpu", torch.float32)
    assert engine.proposer.tree == (3, 2)
    got, tau = texts(engine, prompts[:2], 5, len(references["qwen3"][0]))
    assert [list(got[f"None-{i}"]) for i in range(2)] == references["qwen3"][:2] and tau > 1.0
    raw["model"]["spec_decode"]["draft_tree"] = [2, 17]
    with pytest.raises(InvalidArgument, match="model.spec_decode.draft_tree"):
        parse_config(raw)
