"""The lean runner against transformers, and greedy exactness across query widths."""

from __future__ import annotations

import pytest
import torch

from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.models.kv_cache import slot_rows
from blockspec.common.runtime.runner import Runner, Segment
from blockspec.services.training.tiny import build_tiny_checkpoint
from blockspec.services.verifier.invariance import measure, verify_vs_decode

FAMILY_VARIANTS = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
]


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("variants")
    return [
        build_tiny_checkpoint(root / f"{fam}-{i}", fam, seed=i, tokenizer=tokenizer, **extra)
        for i, (fam, extra) in enumerate(FAMILY_VARIANTS)
    ]


@pytest.mark.parametrize("index", range(len(FAMILY_VARIANTS)), ids=[f"{f}{'-tied' if e else ''}" for f, e in FAMILY_VARIANTS])
def test_logits_match_transformers(index, variant_dirs):
    from transformers import AutoModelForCausalLM

    path = variant_dirs[index]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = Runner(load_checkpoint(path), num_slots=3, max_len=256)
    gen = torch.Generator().manual_seed(index)
    ids = torch.randint(0, hf.config.vocab_size, (3, 40), generator=gen)
    with torch.no_grad():
        ref = hf(ids).logits  # [3, 40, vocab]
    slots = [runner.cache.allocate() for _ in range(3)]
    # Ragged chunks in one batched call each: a prefill chunk, a 1-token decode and a 5-token verify.
    cuts = [(0, 17, 23, 40), (0, 1, 6, 40), (0, 30, 31, 40)]
    got = [[] for _ in range(3)]
    for step in range(3):
        segs = [Segment(slots[b], ids[b, cuts[b][step] : cuts[b][step + 1]].tolist()) for b in range(3)]
        for b, logits in enumerate(runner.forward(segs).logits):
            got[b].append(logits)
    diff = max(float((torch.cat(got[b]) - ref[b]).abs().max()) for b in range(3))
    assert diff < 1e-4


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
def test_verify_and_decode_agree_on_argmax(invariant, variant_dirs, prompts):
    """Argmax of a k+1 verify equals argmax of 1-token decodes at every position; in invariant mode
    (decode padded to the verify width, attention over the whole static cache) logits are bitwise equal."""
    mismatches = positions = 0
    for path in variant_dirs:
        for k in (1, 3, 5, 7):
            runner = Runner(load_checkpoint(path), num_slots=1, max_len=512, query_width=k + 1 if invariant else None)
            for p in prompts:
                block = p[-k - 1 :] if len(p) > k + 1 else list(range(5, 6 + k))
                verify, decode = verify_vs_decode(runner, p, block)
                mismatches += int((verify.argmax(-1) != decode.argmax(-1)).sum())
                positions += k + 1
                if invariant:
                    assert torch.equal(verify, decode)
                else:
                    assert float((verify - decode).abs().max()) < 1e-4
    assert positions > 0 and mismatches == 0


def test_rollback_overwrites_rejected_entries(variant_dirs):
    """Setting a slot's length back and writing other tokens gives the logits of the new sequence."""
    runner = Runner(load_checkpoint(variant_dirs[0]), num_slots=1, max_len=64)
    slot = runner.cache.allocate()
    runner.forward([Segment(slot, [1, 2, 3, 4, 5])])
    runner.cache.set_length(slot, 2)
    after_rollback = runner.forward([Segment(slot, [9, 9])]).logits[0]
    fresh = Runner(load_checkpoint(variant_dirs[0]), num_slots=1, max_len=64)
    s = fresh.cache.allocate()
    expected = fresh.forward([Segment(s, [1, 2, 9, 9])]).logits[0][2:]
    assert torch.allclose(after_rollback, expected, atol=1e-6)


def test_tap_features_are_layer_outputs(variant_dirs):
    from transformers import AutoModelForCausalLM

    path = variant_dirs[2]
    ck = load_checkpoint(path)
    runner = Runner(ck, num_slots=1, max_len=64, tap_layers=(0, 1))
    slot = runner.cache.allocate()
    ids = list(range(3, 13))
    taps = runner.forward([Segment(slot, ids)]).taps[0]  # [10, 2 * hidden]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # hidden_states[0] is the embedding output; [i + 1] the output of decoder layer i (the last one normed).
    assert torch.allclose(taps[:, : ck.config.hidden_size], hs[1][0], atol=1e-5)


def test_measure_reports_zero_mismatches_in_invariant_mode(variant_dirs, prompts):
    ck = load_checkpoint(variant_dirs[1])
    report = measure(ck, [prompts[-1]], ks=(3,), invariant=True, stride=32)
    assert report.positions > 0 and report.argmax_mismatches == 0 and report.max_abs_diff == 0.0


def test_decode_and_verify_attend_in_place_and_long_prefill_chunks_use_sdpa(variant_dirs, monkeypatch):
    """On the CPU, forwards of at most ATTENTION_MAX_QUERIES tokens per row read the KV cache in place
    (no SDPA call); longer prefill chunks go to SDPA. Both give the logits transformers gives (above)."""
    from blockspec.common.kernels import cpu_kernels
    from blockspec.common.models import decoder

    if not cpu_kernels.enabled():
        pytest.skip("the CPU kernels could not be built here")
    calls = []
    sdpa = decoder.F.scaled_dot_product_attention
    monkeypatch.setattr(decoder.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    runner = Runner(load_checkpoint(variant_dirs[2]), num_slots=2, max_len=cpu_kernels.ATTENTION_MAX_QUERIES + 64)
    a, b = runner.cache.allocate(), runner.cache.allocate()
    runner.forward([Segment(a, [t % 60 + 3 for t in range(cpu_kernels.ATTENTION_MAX_QUERIES + 1)])])
    assert calls  # a long prefill chunk
    calls.clear()
    runner.forward([Segment(a, [5]), Segment(b, list(range(7, 15)))])  # a decode and an 8-token prefill
    runner.forward([Segment(a, [5, 6, 7, 8]), Segment(b, [9])])  # a verify and a decode
    assert not calls


def test_keys_read_in_spans_give_the_same_logits(variant_dirs):
    """On CUDA a forward reads the KV cache in spans of CUDA_KEY_SPAN keys, the rest masked (fewer shapes
    for cuDNN's attention to plan). Here through SDPA on the CPU with spans of 8: a batched prefill, a
    decode beside a verify, and two decodes give the logits of exact-length reads."""
    from blockspec.common.kernels import cpu_kernels
    from blockspec.common.models.kv_cache import SlotKVCache

    ck = load_checkpoint(variant_dirs[2])
    cpu_kernels.set_enabled(False)  # every forward through SDPA
    try:
        outs = []
        for step in (1, 8):
            runner = Runner(ck, num_slots=2, max_len=60)
            assert runner.cache.key_step == runner.cache.block_size  # the paged cache reads whole blocks
            runner.cache.key_step = step
            a, b = runner.cache.allocate(), runner.cache.allocate()
            logits = runner.forward([Segment(a, list(range(3, 14))), Segment(b, list(range(20, 25)))]).logits
            logits += runner.forward([Segment(a, [7]), Segment(b, [8, 9, 10])]).logits
            logits += runner.forward([Segment(a, [11]), Segment(b, [12])]).logits
            outs.append(torch.cat(logits))
    finally:
        cpu_kernels.set_enabled(True)
    assert torch.allclose(outs[0], outs[1], atol=1e-5) and torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
    cache = SlotKVCache(1, 1, 1, 60, 4)
    cache.key_step = 8
    assert [cache.key_span(n) for n in (1, 8, 9, 57, 60)] == [8, 8, 16, 60, 60]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_forwards_run_as_one_call_bitwise_the_module_path(family, tmp_path, tokenizer, monkeypatch):
    """A forward attending in place (requests' prefill chunks, verifies, decodes; one row or a padded batch) runs
    the decoder as one C++ call (`cpu_kernels.decoder_rows`): logits, tap features and the K/V it stores are
    bitwise the module path's, and padding stores nothing. Biased projections (qwen2) keep the module path.
    (Hidden size 256: the kernels take projections of whole panels of 64 outputs, the tiny variants' 32-wide
    k / v are not.)"""
    from blockspec.common.kernels import cpu_kernels
    from blockspec.common.models import decoder

    if not cpu_kernels.enabled():
        pytest.skip("the CPU kernels could not be built here")
    path = build_tiny_checkpoint(tmp_path / family, family, hidden_size=256, tokenizer=tokenizer)
    calls, rows = [], cpu_kernels.decoder_rows
    monkeypatch.setattr(cpu_kernels, "decoder_rows", lambda *a: calls.append(tuple(a[0].shape)) or rows(*a))
    results, stored = [], []
    for use_call in (True, False):
        if not use_call:
            monkeypatch.setattr(decoder.Decoder, "_row_weights", lambda self: None)
        for to_dest in (False, True):  # the taps returned, or put where the K/V go
            runner = Runner(load_checkpoint(path), num_slots=3, max_len=128, tap_layers=(0, 1))
            tap_dest = runner.make_tap_buffer().fill_(5.0) if to_dest else None
            a, b, c = runner.cache.allocate(), runner.cache.allocate(), runner.cache.allocate()
            runner.cache.k.fill_(7.0), runner.cache.v.fill_(-7.0)  # what no forward wrote must stay as it was
            segments = [[Segment(a, list(range(3, 103)), last_only=True)],  # a prefill chunk of 100
                        [Segment(a, [5, 6, 7, 8, 9, 10, 11, 12])], [Segment(a, [13])],
                        [Segment(a, [14]), Segment(b, [3, 4, 5])],  # a decode and a prefill, padded
                        [Segment(a, [15, 16, 17, 18]), Segment(b, [6]), Segment(c, [9, 8, 7, 6, 5])]]
            outs = [runner.forward(s, tap_dest) for s in segments]
            if tap_dest is None:
                results.append([*(t for o in outs for t in (*o.logits, o.tap_rows)), runner.cache.k.clone(),
                                runner.cache.v.clone()])
                expected = runner.make_tap_buffer().fill_(5.0)
                for o in outs:
                    o.store(expected, o.tap_rows)
            else:
                assert all(o.tap_rows is None for o in outs)
                stored.append(tap_dest)
                assert torch.equal(tap_dest, expected)  # what store() puts, nothing at padding or untouched rows
    assert all(torch.equal(x, y) for x, y in zip(*results))
    assert torch.equal(*stored)
    one_call = [(1, 100), (1, 8), (1, 1), (2, 3), (3, 5)] * 2  # without a tap_dest and with one
    assert calls == ([] if family == "qwen2" else one_call)  # qwen2: q/k/v biases
    table = runner.cache.table  # the slots' first blocks: c wrote positions 0..4, b 0..3
    assert torch.all(results[0][-2][:, table[c, 0], :, 5:] == 7.0) and torch.all(results[0][-2][:, table[b, 0], :, 4:] == 7.0)
    # And against the target alone: transformers' logits of the same 109 tokens, at the verify's and decode's rows
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([list(range(3, 103)) + list(range(5, 14))])).logits[0]
    got = torch.cat([results[0][2], results[0][4]])  # the verify's 8 rows, then the decode's
    assert float((got - ref[100:109]).abs().max()) < 1e-4


TREE_PARENTS = (-1, 0, 0, 1, 1, 2, 3, 3, 5, 8)  # the anchor, two children, branches of depth up to 4


def test_a_token_tree_gives_each_token_its_paths_logits_and_keep_path_leaves_a_paths_cache(variant_dirs):
    """A draft tree's verify: every token of a tree forward gets the logits (and taps) a sequence forward of its
    root-to-token path gets; after keep_path of a branch the slot continues as if that path had been forwarded."""
    runner = Runner(load_checkpoint(variant_dirs[2]), num_slots=2, max_len=96, tap_layers=(0, 1))
    taps = runner.make_tap_buffer()
    tree_slot, path_slot = runner.cache.allocate(), runner.cache.allocate()
    rows_of = slot_rows(taps, runner.cache.table)  # each slot's taps by position
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, runner.config.vocab_size, (21,), generator=gen).tolist()
    tokens = [prompt[-1], *torch.randint(3, runner.config.vocab_size, (len(TREE_PARENTS) - 1,), generator=gen).tolist()]
    start = len(prompt) - 1
    for slot in (tree_slot, path_slot):
        runner.forward([Segment(slot, prompt[:-1])], taps)
    tree = Segment(tree_slot, tokens, parents=TREE_PARENTS)
    tree_logits = runner.forward([tree], taps).logits[0]
    tree_taps = rows_of[tree_slot][start : start + len(tokens)].clone()
    assert runner.cache.lengths[tree_slot] == start + len(tokens)

    def path_to(i: int) -> list[int]:
        nodes = [i]
        while TREE_PARENTS[nodes[0]] >= 0:
            nodes.insert(0, TREE_PARENTS[nodes[0]])
        return nodes

    for i in range(len(tokens)):
        nodes = path_to(i)
        runner.cache.set_length(path_slot, start)
        logits = runner.forward([Segment(path_slot, [tokens[j] for j in nodes])], taps).logits[0]
        assert float((logits[-1] - tree_logits[i]).abs().max()) < 1e-4, i
        assert float((rows_of[path_slot][start + len(nodes) - 1] - tree_taps[i]).abs().max()) < 1e-4, i

    # Keep the branch 0 -> 2 -> 5 -> 8 -> 9 (tokens stored at start + 0, 2, 5, 8, 9), then decode one more token: as
    # after the same path forwarded as a sequence (path_slot holds it: its last forward was node 9's path).
    kept = path_to(9)
    runner.keep_path(tree_slot, start, kept, taps)
    assert runner.cache.lengths[tree_slot] == runner.cache.lengths[path_slot] == start + len(kept)
    rows = slice(start, start + len(kept))
    assert float((rows_of[tree_slot][rows] - rows_of[path_slot][rows]).abs().max()) < 1e-4
    nxt = int(tree_logits[9].argmax())
    after_tree, after_path = (runner.forward([Segment(slot, [nxt])]).logits[0] for slot in (tree_slot, path_slot))
    assert float((after_tree - after_path).abs().max()) < 1e-4


def test_a_token_tree_is_refused_where_it_cannot_run(variant_dirs, tmp_path, tokenizer):
    from blockspec.services.training.tiny import build_tiny_family

    runner = Runner(load_checkpoint(variant_dirs[0]), num_slots=1, max_len=64)
    slot = runner.cache.allocate()
    for parents in ((0, 0, 1), (-1, 2, 0), (-1, 0)):
        with pytest.raises(ValueError, match=r"do not form a tree over 3 tokens"):
            runner.forward([Segment(slot, [5, 6, 7], parents=parents)])
    hybrid = Runner(load_checkpoint(build_tiny_family(tmp_path / "hybrid", "qwen3_5", tokenizer=tokenizer)),
                    num_slots=1, max_len=64)
    with pytest.raises(ValueError, match="a hybrid's recurrent states follow one sequence"):
        hybrid.forward([Segment(hybrid.cache.allocate(), [5, 6, 7], parents=(-1, 0, 0))])
    from blockspec.common.runtime.cuda_runner import CudaRunner

    graphs = CudaRunner(load_checkpoint(variant_dirs[2]), 1, 64, (), torch.float32, "cpu", warm_up=False)
    with pytest.raises(ValueError, match=r"a token tree \(Segment.parents\) runs on the eager runner"):
        graphs.forward([Segment(graphs.cache.allocate(), [5, 6, 7], parents=(-1, 0, 0))])
