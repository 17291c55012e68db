"""Log-probabilities in OpenAI's shapes: a chat choice's `logprobs.content`, a completion choice's `tokens`,
`token_logprobs`, `top_logprobs` and `text_offset`, from the gRPC API's TokenLogprob messages."""

from __future__ import annotations

import math
from collections.abc import Sequence

from blockspec.protos import api_pb2

FLOOR = -9999.0  # a log-probability of -inf as JSON carries it (vLLM's)


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _value(logprob), "bytes": list(token.encode())}


def chat(logprobs: Sequence[api_pb2.TokenLogprob]) -> dict:
    """A chat choice's (or chunk's) `logprobs`."""
    return {"content": [{**_entry(lp.token, lp.logprob),
                         "top_logprobs": [_entry(t, v) for t, v in zip(lp.top_tokens, lp.top_logprobs)]}
                        for lp in logprobs]}


def completion(logprobs: Sequence[api_pb2.TokenLogprob], offset: int) -> dict:
    """A completion choice's (or chunk's) `logprobs`; offset: the text's length before its first token."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [_value(lp.logprob) for lp in logprobs],
            "top_logprobs": [{t: _value(v) for t, v in zip(lp.top_tokens, lp.top_logprobs)} for lp in logprobs],
            "text_offset": offsets}
