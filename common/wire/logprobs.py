"""Token log-probabilities in their wire form (blockspec.v1.TokenLogprob) and back; float32 carries them exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from blockspec.common.sampling import TokenLogprob
from blockspec.protos import api_pb2


def to_pb(logprobs: Iterable[TokenLogprob], text: Callable[[int], str] | None = None,
          token_ids: Sequence[int] = ()) -> list[api_pb2.TokenLogprob]:
    """text (the public API): a token's text from its id, set for token_ids[i] and logprobs[i]'s top ones."""
    out = [api_pb2.TokenLogprob(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
           for lp in logprobs]
    if text is not None:
        for pb, token in zip(out, token_ids):
            pb.token = text(token)
            pb.top_tokens.extend(text(t) for t in pb.top_ids)
    return out


def from_pb(pbs: Iterable[api_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(pb.logprob, tuple(pb.top_ids), tuple(pb.top_logprobs)) for pb in pbs)
