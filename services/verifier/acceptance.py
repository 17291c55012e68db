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

from blockspec.common.distributions import STREAM_ACCEPT, STREAM_TARGET, DraftDist, LogProbRows, uniform


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


def strict_accept(draft_ids: Sequence[int], logp: LogProbRows, seed: int, position: int) -> Acceptance:
    """Strict rule: the target's token at every position is the Gumbel-max of p with noise keyed by
    (seed, absolute position) - what plain decoding with that seed produces - and a draft token is
    accepted iff it equals it. logp: the rows of p [k + 1, V]; row i samples the token at `position` + i."""
    tokens = []
    for i in range(len(draft_ids) + 1):  # lazily: stop at the first mismatch
        tokens.append(logp.sample(i, seed, position + i, STREAM_TARGET))
        if i == len(draft_ids) or tokens[-1] != draft_ids[i]:
            break
    return Acceptance(num_accepted=len(tokens) - 1, token_ids=tuple(tokens))


def rejection_accept(draft_ids: Sequence[int], logp: LogProbRows, q: DraftDist | None, seed: int,
                     position: int) -> Acceptance:
    """Rejection rule (Leviathan et al. / Chen et al.): accept draft x with probability min(1, p(x) / q(x));
    at the first rejection the *recovered token* is sampled from norm(max(0, p - q)); when all k are
    accepted the *bonus token* is sampled from p. q=None: a deterministic proposer (q one-hot).
    logp: the rows of p [k + 1, V] (rows past the first rejection unread)."""
    q_rows = None if q is None else (q.token_ids.tolist(), q.probs.tolist())  # q(x) lookups in plain Python
    for i, x in enumerate(draft_ids):
        # q(x) and p(x) alone for the test: the whole rows only where the draft is rejected
        q_x = 1.0 if q_rows is None else sum(pr for t, pr in zip(q_rows[0][i], q_rows[1][i]) if t == x)
        if q_x <= 0:  # the draft is not from q: accepting on p alone would not be lossless
            raise ValueError(f"draft token {x} at position {position + i} has q = 0: the draft and its distribution "
                             "do not match")
        if uniform(seed, position + i, STREAM_ACCEPT) * q_x < math.exp(logp.log_p(i, x)):
            continue
        q_ids, q_probs = ((torch.tensor([x]), torch.ones(1, dtype=torch.float64)) if q is None  # one-hot on the draft
                          else (q.token_ids[i], q.probs[i]))
        recovered = logp.sample_residual(i, q_ids, q_probs, seed, position + i, STREAM_ACCEPT, offset=1)
        return Acceptance(num_accepted=i, token_ids=(*draft_ids[:i], recovered))
    k = len(draft_ids)
    bonus = logp.sample(k, seed, position + k, STREAM_ACCEPT, offset=1)
    return Acceptance(num_accepted=k, token_ids=(*draft_ids, bonus))
