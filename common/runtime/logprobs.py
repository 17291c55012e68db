"""Committed tokens' log-probabilities: the raw log_softmax of the target's fp32 logits, with the top alternatives."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockspec.common.sampling import TokenLogprob


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int],
                   top: int) -> tuple[TokenLogprob, ...]:
    """token_ids[i]'s log-probability under logits[rows[i]] ([n, vocab]) and the `top` largest of that row.

    One row at a time: each result's bits depend on its own row only, which the runner keeps the same whatever the
    forward's width (docs/exactness.md), so they are the same with and without speculation."""
    out = []
    for row, token in zip(rows, token_ids):
        logp = torch.log_softmax(logits[row].float(), dim=-1)  # [vocab]
        if top:
            values, ids = torch.topk(logp, top)
            out.append(TokenLogprob(logp[token].item(), tuple(ids.tolist()), tuple(values.tolist())))
        else:
            out.append(TokenLogprob(logp[token].item()))
    return tuple(out)
