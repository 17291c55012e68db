"""The published target families beyond the dense three: the Qwen3.5 hybrids (Gated DeltaNet + gated attention, both
published layouts), their MoE variant and Qwen3-MoE. Each loads, every method's greedy output equals transformers
`generate` of the target alone (one prompt and batched, chunked prefill, k 1, 5, 15), and the linear layers' states
roll back to exactly what the committed tokens give."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.runtime.runner import Runner, Segment
from blockspec.services.engine.engine import Engine
from blockspec.services.training.tiny import build_tiny_drafter, build_tiny_family
from tests.helpers import hf_greedy

NEW = 48  # tokens generated per prompt
LAYOUTS = ("text", "multimodal")
TARGETS = ("qwen3_5-text", "qwen3_5-multimodal", "qwen3_5_moe-text", "qwen3_5_moe-multimodal", "qwen3_moe-text",
           "qwen3_next-text")


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tokenizer) -> dict[str, object]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_tiny_family(root / name, *name.split("-"), tokenizer=tokenizer) for name in TARGETS}


@pytest.fixture(scope="module")
def hybrids(targets) -> dict[str, object]:
    return {layout: targets[f"qwen3_5-{layout}"] for layout in LAYOUTS}


@pytest.fixture(scope="module")
def hybrid_prompts(prompts) -> list[list[int]]:
    return [prompts[2], prompts[4], prompts[6]]  # 7, 33 and 100 tokens


@pytest.fixture(scope="module")
def target_references(targets, hybrid_prompts) -> dict[str, list[list[int]]]:
    return {name: [hf_greedy(path, p, NEW) for p in hybrid_prompts] for name, path in targets.items()}


@pytest.fixture(scope="module")
def hybrid_drafter(hybrids, tmp_path_factory):
    """A random DFlash-2 drafter tapping a linear-attention layer and the full-attention layer (it fits every tiny
    family: 4 layers of 64)."""
    return build_tiny_drafter(tmp_path_factory.mktemp("hybrid-drafter") / "d", hybrids["text"], block_size=16,
                              target_layer_ids=(1, 3))


def test_both_layouts_read_the_layer_types_and_the_text_weights(hybrids, caplog):
    with caplog.at_level(logging.INFO, logger="blockspec.common.models.checkpoint"):
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


def test_the_moe_families_read_their_routing(targets):
    moe = load_checkpoint(targets["qwen3_moe-text"]).config
    assert (moe.experts.num_experts, moe.experts.top_k, moe.experts.norm_topk_prob) == (8, 2, True)
    assert moe.experts.shared_intermediate_size == 0 and not moe.hybrid and moe.qk_norm
    hybrid_moe = load_checkpoint(targets["qwen3_5_moe-multimodal"]).config
    assert hybrid_moe.hybrid and hybrid_moe.experts.shared_intermediate_size == 48
    assert all(hybrid_moe.sparse(i) for i in range(hybrid_moe.num_layers))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("method", "k"), [("none", None), ("ngram", 1), ("ngram", 5), ("ngram", 15), ("dflash", 1),
                                           ("dflash", 5), ("dflash", 15)])
def test_greedy_output_equals_the_target_alone(targets, hybrid_drafter, hybrid_prompts, target_references, target,
                                               method, k):
    """Three prompts of different lengths batched, prefilled 16 tokens per step (chunked), and each one alone."""
    drafter = hybrid_drafter if method == "dflash" else None
    engine = Engine(targets[target], drafter, method, max_batch=3, prefill_chunk=16, threads=1)
    done = engine.complete([engine.request(str(i), p, NEW, k) for i, p in enumerate(hybrid_prompts)])
    assert [list(d.token_ids) for d in done] == target_references[target]
    alone = engine.complete([engine.request("alone", hybrid_prompts[1], NEW, k)])
    assert list(alone[0].token_ids) == target_references[target][1]
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



@pytest.mark.parametrize("target", ["qwen3_5-text", "qwen3_next-text"])
def test_long_prompts_prefilled_by_the_chunked_rule_decode_as_the_recurrence(targets, tokenizer, target, monkeypatch):
    """Prompts of 200, 90 and 120 tokens, prefilled in two forwards (the 200 alone, then the 90 padded beside the
    120), plain and n-gram decoding: the same greedy tokens as with every token run by the recurrence
    (`prefill_blocks` choosing none)."""
    import sysconfig
    from pathlib import Path

    from blockspec.common.models import hybrid

    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    prompts = [ids[1000:1200], ids[3000:3090], ids[5000:5120]]

    def generate(method: str, k: int | None) -> list[list[int]]:
        engine = Engine(targets[target], None, method, max_batch=3, threads=1, prefix_caching=False)
        return [list(d.token_ids) for d in engine.complete([engine.request(str(i), p, 24, k)
                                                            for i, p in enumerate(prompts)])]

    calls = []
    prefill = hybrid.delta_rule_prefill
    monkeypatch.setattr(hybrid, "delta_rule_prefill", lambda *a: calls.append((a[1].shape[:2], a[-1])) or prefill(*a))
    got = {method: generate(method, k) for method, k in (("none", None), ("ngram", 5))}
    # the prefill forwards only, each prompt's whole blocks of 32
    assert set((shape, tuple(c)) for shape, c in calls) == {((1, 200), (192,)), ((2, 120), (64, 96))}
    from blockspec.common.models import state_cache

    monkeypatch.setattr(state_cache, "prefill_blocks", lambda starts, counts: [0] * len(starts))
    want = generate("none", None)
    assert got["none"] == want and got["ngram"] == want


def test_a_prompt_split_on_block_boundaries_or_batched_prefills_the_same_bits(hybrids, tokenizer):
    """A 150-token prompt in one forward, in forwards split on the chunked rule's block boundaries (as
    `Verifier.prefill` splits a hybrid's prompt), and beside another prompt: the same states and last logits, bit for
    bit - its tokens run the same arithmetic (blocks chunked, the rest token by token) however it arrives."""
    ck = load_checkpoint(hybrids["text"])
    prompt = [(37 * i + 11) % 300 + 2 for i in range(150)]
    other = [(53 * i + 5) % 300 + 2 for i in range(70)]
    results = []
    for cuts, beside in (((0, 150), False), ((0, 64, 150), False), ((0, 32, 96, 128, 150), False), ((0, 150), True)):
        runner = Runner(ck, num_slots=2, max_len=256)
        slot, second = runner.cache.allocate(), runner.cache.allocate()
        for a, b in zip(cuts, cuts[1:]):
            segments = [Segment(slot, prompt[a:b], last_only=True)]
            if beside:
                segments.append(Segment(second, other, last_only=True))
            out = runner.forward(segments)
        results.append((_states(runner, slot), out.logits[0]))
    for states, logits in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(states, results[0][0])) and torch.equal(logits, results[0][1])


def test_the_verifier_splits_a_hybrids_prompt_on_block_boundaries(hybrids):
    from blockspec.services.verifier.verifier import Verifier

    verifier = Verifier(load_checkpoint(hybrids["text"]), num_slots=2, max_len=256, max_prefill_tokens=100,
                        prefix_caching=False)  # its saved states cut forwards too (test_prefix_cache.py)
    verifier.add("a", [(37 * i + 11) % 300 + 2 for i in range(150)])
    forwards = []
    forward = verifier.runner.forward
    verifier.runner.forward = lambda segments, taps: forwards.append([len(s.token_ids) for s in segments]) or forward(
        segments, taps)
    verifier.prefill(["a"], budget=90)
    verifier.prefill(["a"])
    assert forwards == [[64], [86]]  # 90 tokens of room: the first forward stops at 64, a block boundary
    small = Verifier(load_checkpoint(hybrids["text"]), num_slots=1, max_len=256, max_prefill_tokens=20,
                     prefix_caching=False)
    small.add("b", list(range(2, 62)))
    assert len(small.prefill(["b"])) == 1  # forwards narrower than a block: unaligned, the prompt still completes

def test_a_rollback_outside_the_last_forward_is_refused(hybrids, hybrid_prompts):
    runner = Runner(load_checkpoint(hybrids["text"]), num_slots=1, max_len=256)
    slot = runner.cache.allocate()
    runner.forward([Segment(slot, hybrid_prompts[1], last_only=True)])
    runner.forward([Segment(slot, [5, 6, 7])])
    with pytest.raises(ValueError, match="linear-attention state holds positions 33..36 of its last forward, not 20"):
        runner.cache.set_length(slot, 20)


def test_the_parameter_count_from_the_config_is_the_checkpoints(targets, tiny_models):
    from blockspec.common.runtime.footprint import parameters

    for path in [*targets.values(), *(d["target"] for d in tiny_models.values())]:
        ck = load_checkpoint(path)
        assert parameters(ck.config).total == sum(t.numel() for t in ck.weights.values()), path.name


def test_info_prints_the_family_layers_and_bytes_per_slot(targets, capsys):
    from blockspec.services.cli.main import main

    assert main(["info", str(targets["qwen3_5_moe-multimodal"]), "--dtype", "float32", "--context", "256"]) == 0
    out = capsys.readouterr().out
    assert "family: qwen3_5_moe; layers: 3 linear_attention, 1 full_attention" in out
    assert "active per token (2 of 8 experts)" in out
    cfg = load_checkpoint(targets["qwen3_5_moe-multimodal"], with_weights=False).config
    kv = 2 * 1 * cfg.num_kv_heads * 256 * cfg.head_dim * 4  # one attention layer, fp32
    recurrent = 2 * 3 * cfg.linear.num_v_heads * 16 * 16 * 4  # two buffers of three layers' states
    assert f"| 256 | {kv / 2**10:,.1f} KiB | " in out and f" | {recurrent / 2**10:,.1f} KiB | " in out


@pytest.fixture(scope="module")
def peaked_hybrid(tmp_path_factory, tokenizer):
    """A tiny Qwen3.5 hybrid whose LM head is scaled up: peaked next-token distributions (a near-uniform target would
    hide a broken rule)."""
    return build_tiny_family(tmp_path_factory.mktemp("peaked") / "h", "qwen3_5", tokenizer=tokenizer, lm_head_scale=40.0)


@pytest.mark.parametrize(("method", "rule"), [
    ("ngram", "rejection"), pytest.param("dflash", "rejection", marks=pytest.mark.slow),
    pytest.param("ngram", "strict", marks=pytest.mark.slow)])
def test_sampled_sequences_of_a_hybrid_follow_its_distribution(peaked_hybrid, hybrid_drafter, tokenizer, method, rule):
    """Sampled 3-token continuations against transformers' exact distribution (chi-square, as
    tests/services/engine/test_sampling.py; 4,000 here, the hybrid's steps being slower). The prompt repeats a prefix
    after the target's own greedy continuation of it, so n-gram drafts are often accepted and often not: the states
    roll back both ways."""
    from blockspec.common.sampling import SamplingParams
    from tests.helpers import P_FAIL, chi_square_p, exact_cells, sample_sequences

    n = 4000
    prefix = tokenizer.encode("    def wrap(self, text):\n")
    prompt = prefix + hf_greedy(peaked_hybrid, prefix, 6) + prefix
    params = SamplingParams(temperature=1.0, rule=rule)
    cells = exact_cells(peaked_hybrid, prompt, params, 3, n)
    engine = Engine(peaked_hybrid, hybrid_drafter if method == "dflash" else None, method, max_batch=512,
                    max_len=len(prompt) + 8, threads=1)
    counts, acceptance = sample_sequences(engine, prompt, params, 3, 2, n)
    p_value = chi_square_p(counts, cells, n)
    assert p_value > P_FAIL, f"chi-square p = {p_value:.2e}: the output is not distributed as the target's samples"
    if method == "ngram":
        assert 0.05 < acceptance < 0.95, f"acceptance {acceptance:.2f}: the rule would not be exercised both ways"


@pytest.mark.parametrize(("target", "method", "k"), [("qwen3_5-text", "dflash", 5), ("qwen3_5-text", "dflash", 15),
                                                     ("qwen3_5-text", "ngram", 5), ("qwen3_moe-text", "dflash", 7),
                                                     ("qwen3_5_moe-text", "ngram", 5)])
def test_the_cuda_runners_steps_equal_the_target_alone(targets, hybrid_drafter, hybrid_prompts, target_references,
                                                       target, method, k):
    """The CUDA runner's steps (`cuda_steps`, uncaptured on the CPU) for the hybrid and MoE families: states read and
    written through device indices, rollbacks replayed with its own recurrence, the routed experts grouped by expert,
    chunked prefill - the same tokens."""
    from blockspec.common.runtime.cuda_runner import CudaRunner

    engine = Engine(targets[target], hybrid_drafter if method == "dflash" else None, method, max_batch=3,
                    prefill_chunk=16, threads=1, backend="graphs")
    assert isinstance(engine.verifier.runner, CudaRunner)
    engine.verifier.runner.graphs.emulate = True  # each bucket computes from the tensors of its first call, as a graph
    done = engine.complete([engine.request(str(i), p, NEW, k) for i, p in enumerate(hybrid_prompts)])
    assert [list(d.token_ids) for d in done] == target_references[target]
    assert sum(d.stats.drafted for d in done) > 0


# The four checkpoints of the report these tests answer, built as it describes: hidden 128, 4 layers (3 linear, 1 full
# attention), 4 attention heads over 2 KV heads of 32 dims, 4 value heads over 2 key heads of 16 dims, conv kernel 4,
# partial rotary 0.25; 8 experts, 2 a token, experts and shared expert of 64, no norm_topk_prob key; every weight of
# two or more dimensions scaled by 3; the shipped target's tokenizer.
REPORTED = (("qwen3_5", "text"), ("qwen3_5", "multimodal"), ("qwen3_5_moe", "text"), ("qwen3_moe", "text"))


def reported_config(family: str, vocab: int) -> dict:
    cfg = {"vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "eos_token_id": 0, "pad_token_id": 0}
    if family != "qwen3_moe":
        cfg.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4, partial_rotary_factor=0.25)
    if family != "qwen3_5":
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    if family == "qwen3_5_moe":
        cfg["shared_expert_intermediate_size"] = 64
        del cfg["intermediate_size"]
    return cfg


@pytest.mark.parametrize(("family", "layout"), REPORTED, ids=["-".join(r) for r in REPORTED])
def test_the_reported_checkpoints_decode_as_transformers_generate(family, layout, tmp_path):
    """Six held-out prompts, 24 tokens each, greedy: plain decoding and dflash at k 5 (a drafter tapping a linear
    layer and the last one) equal transformers' `generate` of the checkpoint's own class."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from blockspec.services.training.tiny import build_family

    shipped = Path(__file__).resolve().parents[3] / "models" / "base"
    tokenizer = AutoTokenizer.from_pretrained(shipped / "target")
    path = build_family(tmp_path / "target", family, reported_config(family, len(tokenizer)), layout,
                        tokenizer=tokenizer, weight_scale=3.0)
    drafter = build_tiny_drafter(tmp_path / "drafter", path, target_layer_ids=(1, 3))
    texts = [json.loads(line) for line in (shipped / "heldout_prompts.jsonl").read_text().splitlines()[:6]]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    want = [hf_greedy(path, p, 24) for p in prompts]
    for method, k in (("none", None), ("dflash", 5)):
        engine = Engine(path, drafter if method == "dflash" else None, method, max_batch=6, threads=1)
        done = engine.complete([engine.request(str(i), p, 24, k) for i, p in enumerate(prompts)])
        assert [list(d.token_ids) for d in done] == want, method
