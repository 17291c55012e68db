"""The target distribution p (common/runtime/distributions.py): processors and warpers against transformers' own,
the counter-based noise, the C++ passes over a row against the tensor maths, the draft picks."""

from __future__ import annotations

import contextlib
import math
import random
from collections import Counter

import pytest
import torch

from blockspec.common.kernels import cpu_kernels
from blockspec.common.runtime.distributions import (
    LogProbRows,
    WalkSampler,
    draft_pick,
    gumbel,
    gumbel_at,
    log_probs,
    process,
    sample,
    uniforms,
)
from blockspec.common.sampling import GREEDY, SamplingParams


def test_processors_equal_transformers_row_by_row():
    """Row i of a verify block sees history + drafts[:i]: each row equals HF's processor on that context."""
    from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    history = torch.randint(0, 12, (30,), generator=g).tolist()
    drafts = [3, 3, 7, 1]
    logits = torch.randn(5, 12, generator=g)
    for params, hf in ((SamplingParams(repetition_penalty=1.3), RepetitionPenaltyLogitsProcessor(1.3)),
                       (SamplingParams(no_repeat_ngram_size=2), NoRepeatNGramLogitsProcessor(2)),
                       (SamplingParams(no_repeat_ngram_size=3), NoRepeatNGramLogitsProcessor(3))):
        ours = process(logits, history, 10, drafts, params)
        for i in range(5):
            context = torch.tensor([history + drafts[:i]])
            assert torch.equal(ours[i], hf(context, logits[i : i + 1].clone())[0]), (params, i)


def test_presence_frequency_count_output_tokens_only_and_bias_adds():
    history, prompt_len = [5, 5, 6, 7, 7, 7], 3  # output so far: 7, 7, 7
    logits = torch.zeros(2, 10)
    out = process(logits, history, prompt_len, [5], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                                                                    logit_bias=((9, 3.0),)))
    assert out[0, 7] == pytest.approx(-0.5 - 0.75) and out[0, 5] == 0.0  # 5 is only in the prompt
    assert out[1, 5] == pytest.approx(-0.5 - 0.25)  # the draft token 5 is output for row 1
    assert out[0, 9] == out[1, 9] == 3.0


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6)])
def test_temperature_top_k_top_p_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)).double() * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = log_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)).exp()
    assert torch.allclose(ours, ref.softmax(-1), atol=1e-12)


def test_noise_is_a_function_of_seed_stream_and_position_only():
    a = uniforms(7, 100, 0, 50)
    assert torch.equal(a, uniforms(7, 100, 0, 50)) and torch.equal(a[:10], uniforms(7, 100, 0, 10))
    for other in (uniforms(8, 100, 0, 50), uniforms(7, 101, 0, 50), uniforms(7, 100, 1, 50)):
        assert not torch.equal(a, other)
    assert bool(((a > 0) & (a < 1)).all())
    # A draft's noise at its candidates only is the same numbers, bit for bit, as the whole vocabulary's there.
    ids = torch.tensor([4095, 3, 700, 0, 3])
    assert torch.equal(gumbel_at(7, 100, 1, ids), gumbel(7, 100, 1, 4096)[ids])
    # Gumbel-max samples p: 20,000 positions of one seed against a 4-token distribution.
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    counts = Counter(sample(p.log(), 3, pos, 0) for pos in range(20_000))
    assert all(abs(counts[i] / 20_000 - float(p[i])) < 0.015 for i in range(4))


def test_noise_is_philox_keyed_by_seed_and_stream_at_the_position():
    """The reused generator gives what a Philox made for each call gives (the definition), in every thread."""
    import threading

    import numpy as np

    def made(seed, position, stream, n):
        u = np.random.Generator(np.random.Philox(key=seed + (stream << 64), counter=position << 128)).random(n)
        return np.maximum(u, np.finfo(np.float64).tiny)

    cases = [(0, 0, 0, 1), (5, 10, 2, 4), (2**64 - 1, 7, 1, 33), (123456789, 2**70 + 3, 2, 320), (9, 1, 0, 4096)]
    for case in cases:
        assert np.array_equal(uniforms(*case).numpy(), made(*case)), case
    seen = []
    worker = threading.Thread(target=lambda: seen.extend(uniforms(*case) for case in cases))
    worker.start()
    worker.join()
    assert all(np.array_equal(u.numpy(), made(*case)) for u, case in zip(seen, cases))


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="the CPU kernels could not be built here")
def test_the_kernels_draw_numpys_noise_and_sample_what_the_tensor_maths_samples():
    """The C++ draws a uniform by its counter alone (numpy's numbers, bit for bit), and its Gumbel-max, which skips the
    tokens that cannot win, picks what argmax(logp + gumbel) picks: peaked, flat, tied and partly impossible rows."""
    rng = random.Random(0)
    for _ in range(300):
        seed, stream = rng.choice([0, 2**64 - 1, rng.getrandbits(64)]), rng.randrange(3)
        position, index = rng.choice([0, rng.randrange(10**6), 2**63 + rng.randrange(9)]), rng.randrange(300)
        assert cpu_kernels.philox_uniform(seed, position, stream, index) == float(uniforms(seed, position, stream,
                                                                                           index + 1)[index])
    torch.manual_seed(0)
    for trial in range(600):
        vocab, scale = rng.choice([1, 2, 7, 320, 4096]), rng.choice([0.1, 1.0, 5.0, 40.0])
        logits = torch.randn(vocab, dtype=torch.float64) * scale
        if trial % 3 == 0:
            logits[torch.rand(vocab) < 0.7] = -math.inf
        if trial % 10 == 0:
            logits[:] = 0.0
        logp = logits.log_softmax(-1) if bool(torch.isfinite(logits).any()) else logits
        seed, position, stream, offset = rng.getrandbits(64), rng.randrange(10**5), rng.randrange(3), trial % 2
        want = int((logp + gumbel(seed, position, stream, vocab, offset)).argmax())
        assert cpu_kernels.gumbel_argmax(logp, seed, position, stream, offset) == want
        assert sample(logp, seed, position, stream, offset) == want
        # the same row as fp32 logits over a temperature: the scores x.double() / T, never materialised
        x, temperature = logits.float(), rng.choice([0.7, 1.0, 1.3])
        want = int((x.double() / temperature + gumbel(seed, position, stream, vocab, offset)).argmax())
        assert cpu_kernels.gumbel_argmax(x, seed, position, stream, offset, temperature) == want
    for trial in range(6):  # rows long enough to be split over the threads: the same pick at any thread count
        x = torch.randn(40_000) * (3.0 if trial % 2 else 0.3)
        want = int((x.double() / 0.7 + gumbel(trial, 9, 0, 40_000)).argmax())
        picks = set()
        for threads in (1, 2):
            with _threads(threads):
                picks.add(cpu_kernels.gumbel_argmax(x, trial, 9, 0, 0, 0.7))
        assert picks == {want}
    assert cpu_kernels.gumbel_argmax(logp, 1, 2**70, 0) is None  # past the counter word it takes: numpy's path


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="the CPU kernels could not be built here")
def test_the_kernels_log_sum_exp_is_torchs():
    torch.manual_seed(1)
    for vocab, scale in ((1, 1.0), (320, 0.1), (4096, 3.0), (4096, 40.0), (60_000, 3.0)):
        x = torch.randn(vocab) * scale
        x[::7] = -math.inf
        x[0] = 1.0
        for threads in (1, 2):
            with _threads(threads):
                got = cpu_kernels.logsumexp(x, 0.7)
            assert abs(got - float(torch.logsumexp(x.double() / 0.7, -1))) < 1e-12
    assert cpu_kernels.logsumexp(torch.full((5,), -math.inf)) == -math.inf


@pytest.mark.parametrize("kernels", [True, False], ids=["c++-noise", "numpy-noise"])
def test_the_batched_walk_sampler_picks_what_draft_pick_picks(kernels):
    """WalkSampler (every row and slot of a walk at once) against draft_pick (one row, one slot): the same index and,
    for rejection rows, the same q; greedy rows take the best of all the scores, past the first Q_WIDTH too."""
    if kernels and not cpu_kernels.enabled():
        pytest.skip("the CPU kernels could not be built here")
    params = [SamplingParams(temperature=0.7, seed=11), SamplingParams(temperature=1.3, seed=2**64 - 1, rule="strict"),
              GREEDY, SamplingParams(temperature=1.0, top_k=5, seed=4)]
    positions, S, K, m = [17, 3, 40, 0], 4, 40, 32
    torch.manual_seed(0)
    candidates = torch.stack([torch.randperm(4096)[:K] for _ in range(len(params) * S)]).reshape(len(params), S, K)
    scores = torch.randn(len(params), S, K) * 3
    before = cpu_kernels.enabled()
    cpu_kernels.set_enabled(kernels)
    try:
        sampler = WalkSampler(params, positions)
        sampler.begin(candidates[..., :m])
        picked = torch.stack([sampler(t, scores[:, t]) for t in range(S)], 1)
    finally:
        cpu_kernels.set_enabled(before)
    q = sampler.q()
    for r, sp in enumerate(params):
        for t in range(S):
            if sp.greedy:
                assert int(picked[r, t]) == int(scores[r, t].argmax())
                continue
            want = draft_pick(scores[r, t, :m], candidates[r, t, :m], sp, positions[r] + t)
            assert int(picked[r, t]) == want.index
            if want.probs is not None:
                torch.testing.assert_close(q[r, t], want.probs, rtol=0, atol=1e-7)


@pytest.mark.parametrize("kernels", [True, False], ids=["c++", "torch"])
def test_the_residual_sample_is_a_sample_of_max_p_minus_q(kernels, monkeypatch):
    """The recovered token (log p with q's tokens replaced) is the Gumbel-max of norm(max(0, p - q)) as the whole rows
    give it, for a q with a token listed twice and for the one-hot q of a deterministic draft; where p == q it is a
    sample of p."""
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "residual_argmax", lambda *a, **k: None)
    elif not cpu_kernels.enabled():
        pytest.skip("the CPU kernels could not be built here")
    torch.manual_seed(0)
    logits = torch.randn(2, 320) * 2
    sp = SamplingParams(temperature=0.8, seed=0)
    rows, logp = LogProbRows(logits, sp), log_probs(logits, sp)
    ids = torch.tensor([[5, 9, 5, 300, int(logp[0].argmax())], [7, 8, 9, 10, int(logp[1].argmax())]])
    probs = torch.tensor([[0.4, 0.3, 0.05, 0.2, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    cases = [(i, ids[i], probs[i]) for i in (0, 1)] + [(0, torch.tensor([3]), torch.ones(1, dtype=torch.float64))]
    for i, q_ids, q_probs in cases:
        dense = torch.zeros(320, dtype=torch.float64).index_add_(0, q_ids, q_probs.double())
        residual = (logp[i].exp() - dense).clamp(min=0).log()
        for seed in range(40):
            want = int((residual + gumbel(seed, 11, 2, 320, 1)).argmax())
            assert rows.sample_residual(i, q_ids, q_probs, seed, 11, 2, 1) == want
    peaked = torch.full((1, 320), -math.inf)
    peaked[0, [4, 6]] = 0.0
    same = LogProbRows(peaked, SamplingParams(temperature=1.0, seed=0))
    for seed in range(20):
        want = int((same[0] + gumbel(seed, 11, 2, 320, 1)).argmax())
        assert same.sample_residual(0, torch.tensor([4, 6]), torch.tensor([0.5, 0.5]), seed, 11, 2, 1) == want


def test_log_prob_rows_are_computed_as_read_and_equal_the_whole_rows():
    processed = torch.randn(6, 320) * 3
    for sp in (SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=1), SamplingParams(temperature=0.7, seed=1)):
        rows = LogProbRows(processed, sp)
        assert rows.shape == processed.shape and not rows._scores and not rows._lse
        whole = log_probs(processed, sp)
        torch.testing.assert_close(rows[3], whole[3], rtol=0, atol=1e-12)
        top = int(whole[3].argmax())
        assert abs(rows.log_p(3, top) - float(whole[3, top])) < 1e-12
        torch.testing.assert_close(rows.at(3, torch.tensor([top, 9])), whole[3, [top, 9]], rtol=0, atol=1e-12)
        assert set(rows._lse) == {3} and set(rows._scores) == {3}
        # a sample reads the scores alone: no normaliser, and without top-k / top-p no copy of the row
        assert rows.sample(5, 1, 20, 0) == int((whole[5] + gumbel(1, 20, 0, 320)).argmax())
        assert set(rows._lse) == {3}
    assert LogProbRows(processed, SamplingParams(temperature=0.7)).scores(2)[0].data_ptr() == processed[2].data_ptr()


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="the CPU kernels could not be built here")
def test_top_k_and_top_p_as_a_floor_keep_what_the_sorted_warp_keeps():
    """On the kernels top-k and top-p are the smallest score kept, found without sorting the row: the same tokens, the
    same p and the same samples as `warp`'s sort (Hugging Face's), over flat, peaked and partly impossible rows of
    fp32 logits, long ones included; a token tied with the last one kept is kept too."""
    rng = random.Random(3)
    torch.manual_seed(3)
    for trial in range(120):
        vocab = rng.choice([7, 320, 4096, 40_000])
        logits = torch.randn(1, vocab) * rng.choice([0.3, 2.5, 8.0])
        if trial % 4 == 0:
            logits[0, torch.rand(vocab) < 0.5] = -math.inf
            logits[0, 0] = 1.0
        sp = SamplingParams(temperature=rng.choice([0.5, 1.0, 1.5]), top_k=rng.choice([0, 1, 5, 50]),
                            top_p=rng.choice([0.5, 0.9, 0.95, 1.0]), seed=trial)
        rows, want = LogProbRows(logits, sp), log_probs(logits, sp)[0]
        row, _, floor = rows.scores(0)
        assert row.data_ptr() == logits[0].data_ptr()  # the logits themselves: no warped copy
        assert torch.equal(torch.isfinite(rows[0]), torch.isfinite(want)), (trial, floor)
        torch.testing.assert_close(rows[0], want, rtol=0, atol=1e-12)
        for position in range(5):
            assert rows.sample(0, trial, position, 0) == int((want + gumbel(trial, position, 0, vocab)).argmax())
    ties = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])  # top-k 2 and top-p 0.7 end inside the tie at 1.0
    for sp in (SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.7)):
        assert torch.isfinite(LogProbRows(ties, sp)[0]).tolist() == [True, True, True, True, False]
