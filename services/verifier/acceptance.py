"""The acceptance rule: which draft tokens the target keeps, and the token it adds itself.

Terms (DESIGN.md): for a draft d1..dk verified as [anchor, d1..dk], the target yields one token per
position. *Accepted tokens* are the longest draft prefix equal to the target's tokens. The
*recovered token* is the target's own token at the first mismatch; if all k drafts are accepted the
target's token after dk is the *bonus token*. Either way a step commits accepted + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Acceptance:
    num_accepted: int
    token_ids: tuple[int, ...]  # accepted drafts, then the recovered or bonus token: num_accepted + 1 ids


def greedy_accept(draft_ids: Sequence[int], target_ids: Sequence[int]) -> Acceptance:
    """Greedy rule. `target_ids` [k + 1] is the target's argmax at each position of [anchor, d1..dk]."""
    k = len(draft_ids)
    if len(target_ids) != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} target tokens, got {len(target_ids)}")
    draft = torch.as_tensor(list(draft_ids), dtype=torch.long)
    target = torch.as_tensor(list(target_ids), dtype=torch.long)
    # The first mismatch zeroes the running product; its sum is the accepted prefix length.
    n = int((draft == target[:k]).cumprod(0).sum()) if k else 0
    return Acceptance(num_accepted=n, token_ids=tuple(int(t) for t in target[: n + 1]))
