"""The acceptance rules: which draft tokens the target keeps, and the token it adds itself.

Terms (docs/architecture.md): a draft d1..dk is verified as [anchor, d1..dk]; row i of the target's output
gives p for the token after d_i. *Accepted tokens* are the draft prefix the rule keeps (greedy and
strict: equal to the target's argmax / seeded sample; rejection: passed the p/q test). The
*recovered token* is the target's own token at the first rejection; if all k drafts are accepted the
target's token after dk is the *bonus token*. Either way a step commits accepted + 1 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockspec.common.distributions import STREAM_ACCEPT, STREAM_TARGET, DraftDist, sample, uniform


@dataclass(frozen=True)
class Acceptance:
    num_accepted: int
    token_ids: tuple[int, ...]  # accepted drafts, then the recovered or bonus token: num_accepted + 1 ids


def greedy_accept(draft_ids: Sequence[int], target_ids: Sequence[int]) -> Acceptance:
    """Greedy rule. `target_ids` [k + 1] is the target's argmax at each position of [anchor, d1..dk]."""
    k = len(draft_ids)
    if len(target_ids) != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} target tokens, got {len(target_ids)}")
    n = 0  # plain Python: a few small lists, where tensor ops' dispatch costs more than the comparison
    while n < k and int(draft_ids[n]) == int(target_ids[n]):
        n += 1
    return Acceptance(num_accepted=n, token_ids=tuple(int(t) for t in target_ids[: n + 1]))


def strict_accept(draft_ids: Sequence[int], logp, seed: int, position: int) -> Acceptance:
    """Strict rule: the target's token at every position is the Gumbel-max of p with noise keyed by
    (seed, absolute position) - what plain decoding with that seed produces - and a draft token is
    accepted iff it equals it. logp [k + 1, V] (a tensor or `distributions.LogProbRows`); row i samples the token
    at `position` + i."""
    tokens = []
    for i in range(len(draft_ids) + 1):  # lazily: stop at the first mismatch
        tokens.append(sample(logp[i], seed, position + i, STREAM_TARGET))
        if i == len(draft_ids) or tokens[-1] != draft_ids[i]:
            break
    return Acceptance(num_accepted=len(tokens) - 1, token_ids=tuple(tokens))


def rejection_accept(draft_ids: Sequence[int], logp, q: DraftDist | None, seed: int,
                     position: int) -> Acceptance:
    """Rejection rule (Leviathan et al. / Chen et al.): accept draft x with probability min(1, p(x) / q(x));
    at the first rejection the *recovered token* is sampled from norm(max(0, p - q)); when all k are
    accepted the *bonus token* is sampled from p. q=None: a deterministic proposer (q one-hot).
    logp: log p rows [k + 1, V], a tensor or `distributions.LogProbRows` (rows past the first rejection unread)."""
    for i, x in enumerate(draft_ids):
        row = logp[i]
        # q(x) and p(x) alone for the test: the whole rows only where the draft is rejected
        q_x = 1.0 if q is None else sum(pr for t, pr in zip(q.token_ids[i].tolist(), q.probs[i].tolist()) if t == x)
        if q_x <= 0:  # the draft is not from q: accepting on p alone would not be lossless
            raise ValueError(f"draft token {x} at position {position + i} has q = 0: the draft and its distribution "
                             "do not match")
        if uniform(seed, position + i, STREAM_ACCEPT) * q_x < math.exp(float(row[x])):
            continue
        recovered = sample(_residual(row, q, i, x), seed, position + i, STREAM_ACCEPT, offset=1)
        return Acceptance(num_accepted=i, token_ids=(*draft_ids[:i], recovered))
    k = len(draft_ids)
    bonus = sample(logp[k], seed, position + k, STREAM_ACCEPT, offset=1)
    return Acceptance(num_accepted=k, token_ids=(*draft_ids, bonus))


def _residual(logp: torch.Tensor, q: DraftDist | None, i: int, x: int) -> torch.Tensor:
    """log max(0, p - q) of draft position i, unnormalized, for its Gumbel-max: q is zero outside its row's tokens,
    so only those entries differ from log p (a sparse update, not a pass over the vocabulary per term). Where the
    residual has no mass (p == q), log p itself: p is the answer."""
    if q is None:  # one-hot on the draft
        ids, q_s = torch.tensor([x]), torch.ones(1, dtype=torch.float64)
    else:
        ids, q_s = q.token_ids[i], q.probs[i].double()
        if len(set(ids.tolist())) < len(ids):  # a token listed twice counts its probabilities together
            ids, where = torch.unique(ids, return_inverse=True)
            q_s = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, where, q_s)
    p_s = logp.index_select(0, ids).exp()
    if 1.0 - float(torch.minimum(p_s, q_s).sum()) <= 0:  # sum(max(0, p - q)) = 1 - sum(min(p, q))
        return logp
    return logp.clone().index_copy_(0, ids, (p_s - q_s).clamp(min=0).log())
