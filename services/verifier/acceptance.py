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

from blockspec.common.contracts import DraftTree
from blockspec.common.runtime.distributions import (
    STREAM_ACCEPT,
    STREAM_SIBLING,
    STREAM_TARGET,
    DraftDist,
    LogProbRows,
    sample,
    uniform,
)


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


def tree_accept(tree: DraftTree, rule: str, logp: LogProbRows | None, target_ids: Sequence[int] | None, seed: int,
                position: int) -> tuple[Acceptance, list[int]]:
    """A rule down a draft tree verified as [anchor, tree tokens]: row 0 of p is the anchor's, row i + 1 token i's.
    From the anchor, each node's children are judged in their order and the first accepted one is followed; where none
    is (or at a leaf) the target adds its own token, as on a path. greedy: the child equal to target_ids[row] (the
    argmax); strict: the child equal to the target's seeded sample; rejection (Jeon et al., "Recursive Speculative
    Decoding"): child j is accepted with min(1, p_j(x) / q_j(x)), where after each rejection p_{j+1} =
    norm(max(0, p_j - q_j)) and q_{j+1} is q_j without x, renormalised; the children were drawn from q without
    replacement in that order (DraftTree.q). One child per node is `rejection_accept`'s test, bit for bit.
    Returns the acceptance and the accepted tokens' indices in the tree, root to leaf."""
    children = tree.children()
    path: list[int] = []
    tokens: list[int] = []
    row = 0
    while True:
        at = position + len(path)  # the position of the token this row decides
        kids = children[row]
        if rule == "rejection":
            chosen, token = _judge(tree, kids, row, logp, seed, at)
        else:
            token = int(target_ids[row]) if rule == "greedy" else logp.sample(row, seed, at, STREAM_TARGET)
            chosen = next((c for c in kids if tree.token_ids[c] == token), None)
        tokens.append(token)
        if chosen is None:
            return Acceptance(len(path), tuple(tokens)), path
        path.append(chosen)
        row = chosen + 1


def _judge(tree: DraftTree, kids: list[int], row: int, logp: LogProbRows, seed: int,
           position: int) -> tuple[int | None, int]:
    """The rejection rule at one node: (the accepted child or None, the token it commits)."""
    if not kids:  # a leaf: the bonus token
        return None, logp.sample(row, seed, position, STREAM_ACCEPT, offset=1)
    q_ids, q_probs = tree.q.token_ids[row], tree.q.probs[row]
    if len(kids) == 1:
        x = tree.token_ids[kids[0]]
        q_x = float(q_probs[q_ids == x].sum())
        _check_q(q_x, x, position)
        if uniform(seed, position, STREAM_ACCEPT) * q_x < math.exp(logp.log_p(row, x)):
            return kids[0], x
        return None, logp.sample_residual(row, q_ids, q_probs, seed, position, STREAM_ACCEPT, offset=1)
    p = logp[row].exp()  # fp64 [V]
    q = torch.zeros_like(p).index_add_(0, q_ids, q_probs.double())
    for j, child in enumerate(kids):
        x = tree.token_ids[child]
        _check_q(float(q[x]), x, position)
        u = uniform(seed, position, STREAM_ACCEPT) if j == 0 else uniform(seed, position, STREAM_SIBLING, j - 1)
        if u * float(q[x]) < float(p[x]):
            return child, x
        residual = (p - q).clamp_min_(0.0)
        total = float(residual.sum())
        p = residual / total if total > 0 else p  # total 0: p equals q, whose draw is never rejected
        q[x] = 0.0
        mass = float(q.sum())
        q = q / mass if mass > 0 else q  # no mass left: no later child can have been drawn from it
    return None, sample(p.log(), seed, position, STREAM_ACCEPT, offset=1)


def _check_q(q_x: float, x: int, position: int) -> None:
    if q_x <= 0:  # the draft is not from q: accepting on p alone would not be lossless
        raise ValueError(f"draft token {x} at position {position} has q = 0: the draft and its distribution do not "
                         "match")
