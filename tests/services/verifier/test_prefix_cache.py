"""The paged KV cache and its prefix cache never change a token: a request served from cached blocks (of a shared
system prompt, of an earlier turn and its reply) returns what a cold cache returns, whatever the prefill chunking and
the cache's state; a cache too small for every request preempts and resumes them, each stream exact and whole."""

from __future__ import annotations

import random

import pytest

from blockspec.common.models.block_pool import BlockPool, OutOfBlocks
from blockspec.common.sampling import SamplingParams
from blockspec.common.tokens.prefix_hash import block_hashes
from blockspec.services.engine.engine import Engine
from blockspec.services.router.step_loop import FinishEvent, TokenEvent


def test_block_pool_shares_caches_and_evicts_least_recently_used():
    pool = BlockPool(4)
    a, b = pool.take(), pool.take()
    pool.publish([a, b], [11, 12])
    assert pool.match([11, 12, 13]) == [a, b] and pool.free == 2  # held twice now
    for block in (a, b, a, b):
        pool.drop(block)
    assert pool.free == 4 and pool.cached == 2
    c, d = pool.take(), pool.take()  # the free ones first
    assert {c, d}.isdisjoint({a, b}) and pool.match([11]) == [a]
    pool.drop(a)
    assert pool.take() == b and pool.stats.evictions == 1  # b was used less recently than a
    assert pool.match([11, 12]) == [a]  # b's hash is gone: the chain stops there
    with pytest.raises(OutOfBlocks):
        pool.take()


def test_block_hashes_chain_and_salt():
    ids = list(range(40))
    assert block_hashes(ids, 16) == block_hashes(ids[:32] + [99] * 8, 16)  # a partial block has no hash
    assert block_hashes(ids, 16)[1] != block_hashes([1] + ids[1:], 16)[1]  # block 1's hash covers block 0's tokens
    assert block_hashes(ids, 16, "tenant-a") != block_hashes(ids, 16, "tenant-b")
    assert len(block_hashes(ids, 16, limit=1)) == 1


def _run(engine, turns, rng, salt=""):
    """Each turn's greedy tokens (random prefill chunking each turn), its streamed tokens checked against its finish."""
    out = []
    for i, prompt in enumerate(turns):
        engine.loop.prefill_chunk = rng.choice([3, 16, 17, 40, 512])
        streamed, done = [], None
        k = None if engine.proposer.max_k == 0 else 4
        for e in engine.generate([engine.request(f"t{i}", prompt, 24, k, cache_salt=salt)]):
            if isinstance(e, TokenEvent):
                streamed.extend(e.token_ids)
            elif isinstance(e, FinishEvent):
                done = e
        assert list(done.token_ids) == streamed
        out.append((streamed, done.stats.accepted, done.stats.steps))
    return out


@pytest.mark.parametrize("method", ["none", "ngram", "dflash"])
def test_cache_hits_return_a_cold_caches_tokens(method, tiny_models, dflash_drafters, prompts):
    """A conversation of 4 turns over a shared system prompt (each turn: the last one's prompt, its reply and a new
    message), after a random warm-up of other prompts: the same tokens as with prefix caching off, and for dflash the
    same acceptance (its context comes from the cached blocks' taps). Greedy and strict seeded sampling."""
    target = tiny_models["qwen3"]["target"]
    drafter = dflash_drafters["qwen3-trained"] if method == "dflash" else None
    rng = random.Random(7)
    system = prompts[7][:100]  # 6 full blocks and 4 tokens
    for sampling in (None, SamplingParams(temperature=0.8, seed=5, rule="strict")):
        results = []
        for caching in (False, True):
            engine = Engine(target, drafter, method, max_batch=2, max_len=512, prefix_caching=caching)
            if sampling is not None:
                engine.request = _with_sampling(engine.request, sampling)
            _run(engine, [system[: rng.randrange(20, 100)] + prompts[6][j : j + 9] for j in range(3)], rng)  # warm-up
            turns, history = [], system + prompts[6][:9]
            conversation = []
            for turn in range(4):
                turns = [history]
                (reply, accepted, steps), = _run(engine, turns, rng)
                conversation.append((reply, accepted, steps))
                history = history + reply + prompts[6][10 + turn * 7 : 17 + turn * 7]
            results.append(conversation)
            if caching:
                stats = engine.verifier.prefix_stats
                assert stats.hits > stats.queries / 2  # the later turns came mostly from the cache
        cold, warm = results
        assert [r[0] for r in warm] == [r[0] for r in cold]
        if method == "dflash" and sampling is None:
            assert [r[1:] for r in warm] == [r[1:] for r in cold]  # acceptance and steps too


def _with_sampling(request, sampling):
    def make(*args, **kwargs):
        kwargs.setdefault("sampling", sampling)
        return request(*args, **kwargs)
    return make


def test_a_tenants_blocks_are_not_shared_with_another(tiny_models, prompts):
    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=1, max_len=256)
    prompt = prompts[6][:48]
    rng = random.Random(0)
    _run(engine, [prompt], rng, salt="a")
    _run(engine, [prompt], rng, salt="b")
    assert engine.verifier.prefix_stats.hits == 0
    _run(engine, [prompt], rng, salt="a")
    assert engine.verifier.prefix_stats.hits == 32  # its two full blocks before the last token


def test_preemption_keeps_every_stream_exact(tiny_models, prompts, references):
    """A cache of 10 blocks (160 positions) for 4 requests of up to 120 each: admission waits for blocks and the
    latest admitted are preempted as the others grow; each resumes, and every stream is the target's greedy
    continuation, each token streamed once."""
    engine = Engine(tiny_models["llama"]["target"], tiny_models["llama"]["other"], "draft_model", max_batch=4,
                    max_len=160, kv_cache_tokens=160)
    requests = [engine.request(f"r{i}", prompts[i][:20], 100, 3) for i in range(4)]
    streamed = {r.request_id: [] for r in requests}
    done = {}
    for e in engine.generate(requests):
        if isinstance(e, TokenEvent):
            streamed[e.request_id].extend(e.token_ids)
        else:
            done[e.request_id] = e
    assert engine.loop.preemptions > 0
    for i, r in enumerate(requests):
        assert streamed[r.request_id] == list(done[r.request_id].token_ids)
    from tests.helpers import hf_greedy

    target = tiny_models["llama"]["target"]
    for i, r in enumerate(requests):
        assert list(done[r.request_id].token_ids) == hf_greedy(target, prompts[i][:20], 100), r.request_id
    assert engine.verifier.free_blocks == engine.verifier.num_blocks


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_prompts_kv_and_taps_do_not_depend_on_chunking_or_cache_hits(family, tmp_path, tokenizer, prompts):
    """Prompts sharing prefixes, prefilled in random chunks after random earlier requests, with the prefix cache on
    and off: every position's K/V in every layer and its tap features are the same bits, and so is the first
    token. (Hidden size 256: the CPU kernels take its projections, whose rows do not depend on the row count; torch's
    GEMM, which runs the tiny variants' 32-wide k / v, sums in an order that does.)"""
    import torch

    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.training.tiny import build_tiny_checkpoint
    from blockspec.services.verifier.verifier import Verifier

    checkpoint = load_checkpoint(build_tiny_checkpoint(tmp_path / family, family, hidden_size=256, tokenizer=tokenizer))
    rng = random.Random(3)
    base = prompts[7] + prompts[6]
    wanted = [base[: rng.randrange(40, 160)] for _ in range(6)]
    seen = []
    for caching in (False, True):
        verifier = Verifier(checkpoint, num_slots=3, max_len=256, tap_layers=(0, 1), prefix_caching=caching)
        kept = []
        for i, prompt in enumerate(wanted):
            for j in range(rng.randrange(0, 3)):  # other requests before it, released: the cache's state varies
                verifier.add(f"other{i}-{j}", base[: rng.randrange(20, 150)])
                verifier.prefill([f"other{i}-{j}"], rng.choice([None, 16, 33]))
                while verifier.runner.cache.lengths[verifier.slot_of(f"other{i}-{j}")] < len(verifier.committed(f"other{i}-{j}")) - 1:
                    verifier.prefill([f"other{i}-{j}"], 64)
                verifier.release(f"other{i}-{j}")
            verifier.add("r", prompt)
            results = []
            while not results:
                results = verifier.prefill(["r"], rng.choice([7, 16, 50, None]))
            cache, slot = verifier.runner.cache, verifier.slot_of("r")
            table = cache.table[slot : slot + 1]
            kv = [torch.cat(cache.gather(layer, table, len(prompt))) for layer in range(cache.k.shape[0])]
            kept.append((results[0].token_ids, torch.stack(kv), verifier.features("r")[0 : len(prompt)].clone()))
            verifier.release("r")
        seen.append(kept)
        if caching:
            assert verifier.prefix_stats.hits > 0
    for (tokens0, kv0, taps0), (tokens1, kv1, taps1) in zip(*seen):
        assert tokens0 == tokens1 and torch.equal(kv0, kv1) and torch.equal(taps0, taps1)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_hybrid_resumes_cached_prefixes_from_saved_states(family, tmp_path, tokenizer, prompts):
    """A hybrid's cached prefix comes with its linear layers' states, saved where a prefill passed a multiple of 32
    positions: prompts sharing prefixes, in random chunks after random earlier requests, give the first token and the
    attention layers' K/V of a cold cache, with prefix hits; then a conversation's turns give the same tokens."""
    import torch

    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.training.tiny import build_tiny_family
    from blockspec.services.verifier.verifier import Verifier

    path = build_tiny_family(tmp_path / family, family, tokenizer=tokenizer, lm_head_scale=4.0)
    checkpoint = load_checkpoint(path)
    rng = random.Random(5)
    base = prompts[7] + prompts[6]
    wanted = [base[: rng.randrange(40, 160)] for _ in range(6)]
    seen, hits = [], 0
    for caching in (False, True):
        verifier = Verifier(checkpoint, num_slots=2, max_len=256, prefix_caching=caching)
        kept = []
        for i, prompt in enumerate(wanted):
            if rng.random() < 0.5:  # another request before it, released: the cache's state varies
                verifier.add("other", base[: rng.randrange(20, 150)])
                while not verifier.prefill(["other"], rng.choice([32, 64, None])):
                    pass
                verifier.release("other")
            verifier.add("r", prompt)
            results = []
            while not results:
                results = verifier.prefill(["r"], rng.choice([32, 96, None]))
            cache, slot = verifier.runner.cache, verifier.slot_of("r")
            table = cache.table[slot : slot + 1]
            kv = torch.stack([torch.cat(cache.gather(layer, table, len(prompt))) for layer in range(cache.k.shape[0])])
            kept.append((results[0].token_ids, kv))
            verifier.release("r")
        seen.append(kept)
        hits = verifier.prefix_stats.hits
    assert hits > 0
    for (tokens0, kv0), (tokens1, kv1) in zip(*seen):
        assert tokens0 == tokens1
        torch.testing.assert_close(kv0, kv1, rtol=1e-5, atol=1e-5)  # torch's GEMM runs the tiny shapes
    results = []
    for caching in (False, True):
        engine = Engine(path, None, "ngram", max_batch=1, max_len=512, prefix_caching=caching)
        history, replies = base[:70], []
        for turn in range(3):
            (reply, _, _), = _run(engine, [history], random.Random(turn))
            replies.append(reply)
            history = history + reply + prompts[6][turn * 9 : turn * 9 + 9]
        results.append(replies)
        if caching:
            assert engine.verifier.prefix_stats.hits >= 64
    assert results[0] == results[1]


def test_preemption_counts_every_node_of_a_draft_tree(tiny_models, dflash_drafters, prompts):
    """A draft tree's verify writes all its nodes (3 + 9 + 9 at k 3 with children (3, 3), not k + 1): the room made
    before it counts them, so a cache too small for 4 requests preempts instead of failing the step."""
    from tests.helpers import hf_greedy

    target = tiny_models["qwen3"]["target"]
    engine = Engine(target, dflash_drafters["qwen3-trained"], "dflash", max_batch=4, max_len=160, kv_cache_tokens=160,
                    draft_tree=(3, 3))
    requests = [engine.request(f"r{i}", prompts[6][i : i + 20], 100, 3) for i in range(4)]
    done = engine.complete(requests)
    assert engine.loop.preemptions > 0
    for i, event in enumerate(done):
        assert list(event.token_ids) == hf_greedy(target, prompts[6][i : i + 20], 100), i


def test_a_sequences_hashes_extend_to_those_of_the_whole():
    from blockspec.common.tokens.prefix_hash import extend_hashes

    ids, hashes = list(range(100)), []
    extend_hashes(hashes, ids[:40], 16, "t")
    assert len(hashes) == 2
    assert extend_hashes(hashes, ids, 16, "t", 5) == block_hashes(ids, 16, "t")[:5]
    assert extend_hashes(hashes, ids, 16, "t") == block_hashes(ids, 16, "t")
