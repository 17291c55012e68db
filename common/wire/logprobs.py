"""Token log-probabilities in their wire form (blockspec.v1.TokenLogprob) and back; float32 carries them exactly."""

from __future__ import annotations

from collections.abc import Iterable

from blockspec.common.contracts import TokenLogprob
from blockspec.protos import api_pb2


def to_pb(logprobs: Iterable[TokenLogprob]) -> list[api_pb2.TokenLogprob]:
    return [api_pb2.TokenLogprob(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
            for lp in logprobs]


def from_pb(pbs: Iterable[api_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(pb.logprob, tuple(pb.top_ids), tuple(pb.top_logprobs)) for pb in pbs)
