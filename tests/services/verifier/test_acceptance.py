"""The acceptance rules at the function level: greedy's table (vLLM style: the accepted prefix, then the recovered
or bonus token), the rejection and strict rules' output distribution, a draft its q does not cover."""

from __future__ import annotations

import math

import pytest
import torch

from blockspec.common.runtime.distributions import (
    STREAM_DRAFT,
    DraftDist,
    LogProbRows,
    gumbel,
)
from blockspec.common.sampling import SamplingParams
from blockspec.services.verifier.acceptance import Acceptance, greedy_accept, rejection_accept, strict_accept


@pytest.mark.parametrize(
    ("draft", "target", "expected"),
    [
        ((5, 6, 7), (5, 6, 7, 8), Acceptance(3, (5, 6, 7, 8))),  # all accepted + bonus
        ((5, 6, 7), (5, 9, 7, 8), Acceptance(1, (5, 9))),  # first mismatch at position 1 -> recovered 9
        ((5, 6, 7), (4, 6, 7, 8), Acceptance(0, (4,))),  # first token rejected
        ((5, 6, 7), (5, 6, 1, 8), Acceptance(2, (5, 6, 1))),  # mismatch at the last draft
        ((), (3,), Acceptance(0, (3,))),  # empty draft: plain decoding
        ((5,), (5, 2), Acceptance(1, (5, 2))),  # k=1 accepted + bonus
        ((5,), (6, 2), Acceptance(0, (6,))),  # k=1 rejected
        ((5, 5, 5), (5, 4, 5, 5), Acceptance(1, (5, 4))),  # later matches after a mismatch do not count
    ],
)
def test_greedy_accept(draft, target, expected):
    assert greedy_accept(draft, target) == expected


def test_target_length_must_be_k_plus_one():
    with pytest.raises(ValueError, match="k \\+ 1"):
        greedy_accept((1, 2), (1, 2))


def _rule_output_distribution(p: torch.Tensor, q: torch.Tensor, k: int, n: int, rule) -> torch.Tensor:
    """First committed token over n seeds: drafts sampled from q with the drafter's noise, then `rule`."""
    counts = torch.zeros(p.shape[-1], dtype=torch.float64)
    logp = LogProbRows(p.log().expand(k + 1, -1), SamplingParams(temperature=1.0))
    ids = torch.arange(p.shape[-1]).expand(k, -1)
    for seed in range(n):
        drafts = [int((q.log() + gumbel(seed, 10 + i, STREAM_DRAFT, q.shape[-1])).argmax()) for i in range(k)]
        acc = rule(drafts, logp, DraftDist(ids, q.float().expand(k, -1)), seed, 10)
        counts[acc.token_ids[0]] += 1
    return counts / n


def test_rejection_rule_keeps_p_whatever_q_and_strict_rule_samples_p():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    n = 10_000
    bound = 4 * math.sqrt(0.25 / n)  # four standard deviations of a frequency: 0.02, where q is 0.4 off p
    got = _rule_output_distribution(p, q, 2, n, rejection_accept)
    assert float((got - p).abs().max()) < bound
    strict = _rule_output_distribution(p, q, 2, n, lambda d, lp, _q, s, pos: strict_accept(d, lp, s, pos))
    assert float((strict - p).abs().max()) < bound
    # Accepting whatever was drafted returns q, which the same bound rejects.
    naive = _rule_output_distribution(p, q, 2, n, lambda d, lp, _q, s, pos: type(strict_accept(d, lp, s, pos))(2, tuple(d) + (0,)))
    assert float((naive - p).abs().max()) > bound


def test_a_draft_its_q_does_not_cover_fails_instead_of_being_accepted():
    """q(x) = 0 for a drafted x means the draft and its distribution do not match (rows misaligned, a stale shared
    buffer): u * q(x) < p(x) would accept it whatever p, which is not lossless. The rule refuses it."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64)
    q = DraftDist(torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.4]]))  # the draft, 3, is not in q's support
    with pytest.raises(ValueError, match="draft token 3 at position 10 has q = 0"):
        rejection_accept([3], LogProbRows(p.log().expand(2, -1), SamplingParams(temperature=1.0)), q, 1, 10)
