"""How a request samples: its parameters, their validation (errors name the field) and their wire form, and the
log-probabilities it may ask for of each token.

The maths that turns them into the target distribution p lives in distributions.py; this module stays free of
torch, so the router can read and check a request without it.
"""

from __future__ import annotations

import math
import secrets
import struct
from dataclasses import dataclass, field, replace

from blockspec.common.errors import InvalidArgument

RULES = ("rejection", "strict")
DEFAULT_RULE = "rejection"
MAX_LOGPROBS = 20  # top alternatives a token's log-probabilities may list (OpenAI's bound)
MIN_TEMPERATURE = 1e-5  # below it (and above 0) logits / T overflow: refused, as vLLM treats it as greedy
_WIRE_MIN_TEMPERATURE = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]  # 1e-5 as gRPC's float32 carries it


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy: the argmax of the processed logits
    top_p: float = 1.0  # keep the smallest set of tokens holding this much probability
    top_k: int = 0  # 0 = off
    seed: int | None = None  # resolved at admission when unset, so every sample is reproducible from it
    rule: str = DEFAULT_RULE  # verification rule when sampling: rejection | strict
    repetition_penalty: float = 1.0  # HF/CTRL: logits of tokens already in prompt + output / (or *) this
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    no_repeat_ngram_size: int = 0  # HF: ban tokens that would repeat an n-gram of prompt + output
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # (token id, added to its logit)
    # Each generated token's log-probability and this many top alternatives (0..MAX_LOGPROBS); None = off. They are
    # the raw log_softmax of the target's logits (common/runtime/logprobs.py), whatever the processors do.
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.no_repeat_ngram_size or self.logit_bias)

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: the fast path."""
        return self.greedy and not self.has_processors


GREEDY = SamplingParams()


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target and the most likely tokens' at its position."""

    logprob: float
    top_ids: tuple[int, ...] = ()  # most likely first
    top_logprobs: tuple[float, ...] = ()


def _check_finite(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise InvalidArgument(f"sampling.{name}", f"must be a number in {bound}, got {value}")


def checked(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """Refuse what we cannot honour, naming the field; returns the params with the seed resolved."""
    _check_finite("temperature", params.temperature, 0.0, 100.0)
    if 0.0 < params.temperature < _WIRE_MIN_TEMPERATURE:  # the logits / T would overflow to NaN: say so, no silent token 0
        raise InvalidArgument("sampling.temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                                                      f"{params.temperature}")
    _check_finite("top_p", params.top_p, 0.0, 1.0, low_open=True)
    if params.top_k < 0:
        raise InvalidArgument("sampling.top_k", f"must be 0 (off) or positive, got {params.top_k}")
    if params.seed is not None and not 0 <= params.seed < 2**64:
        raise InvalidArgument("sampling.seed", f"must be in [0, 2^64), got {params.seed}")
    if params.rule not in RULES:
        raise InvalidArgument("sampling.rule", f"unknown rule {params.rule!r}; choose one of {', '.join(RULES)}")
    _check_finite("repetition_penalty", params.repetition_penalty, 0.0, 10.0, low_open=True)
    _check_finite("presence_penalty", params.presence_penalty, -2.0, 2.0)
    _check_finite("frequency_penalty", params.frequency_penalty, -2.0, 2.0)
    if params.no_repeat_ngram_size < 0:
        raise InvalidArgument("sampling.no_repeat_ngram_size", f"must be 0 (off) or positive, got {params.no_repeat_ngram_size}")
    for token, bias in params.logit_bias:
        if not 0 <= token < vocab_size:
            raise InvalidArgument("sampling.logit_bias", f"token id {token} is outside the vocabulary of {vocab_size}")
        _check_finite("logit_bias", bias, -100.0, 100.0)
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument("sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}], got {params.logprobs}")
    if params.seed is None and not params.greedy:
        params = replace(params, seed=secrets.randbits(63))
    return params


def from_pb(pb) -> SamplingParams:
    """blockspec.v1.SamplingParams -> SamplingParams (proto defaults mean "off"); check it with `checked` afterwards."""
    return SamplingParams(
        temperature=pb.temperature, top_p=pb.top_p or 1.0, top_k=pb.top_k,
        seed=pb.seed if pb.HasField("seed") else None, rule=pb.rule or DEFAULT_RULE,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        presence_penalty=pb.presence_penalty, frequency_penalty=pb.frequency_penalty,
        no_repeat_ngram_size=pb.no_repeat_ngram_size, logit_bias=tuple(sorted(pb.logit_bias.items())),
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
    )


def fill_pb(params: SamplingParams, pb) -> None:
    """Write params into a blockspec.v1.SamplingParams message."""
    pb.temperature, pb.top_p, pb.top_k, pb.rule = params.temperature, params.top_p, params.top_k, params.rule
    if params.seed is not None:
        pb.seed = params.seed
    if params.repetition_penalty != 1.0:
        pb.repetition_penalty = params.repetition_penalty
    pb.presence_penalty, pb.frequency_penalty = params.presence_penalty, params.frequency_penalty
    pb.no_repeat_ngram_size = params.no_repeat_ngram_size
    for token, bias in params.logit_bias:
        pb.logit_bias[token] = bias
    if params.logprobs is not None:
        pb.logprobs = params.logprobs
