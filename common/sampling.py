"""The target distribution p, defined once: sampling parameters, logits processors (penalties, bans,
bias), temperature / top-k / top-p, and the counter-based noise every sample draws from.

Used by plain decoding and by every verification rule, and (noise, draft picks) by the proposers.
"""

from __future__ import annotations

import math
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from blockspec.common.errors import InvalidArgument

RULES = ("rejection", "strict")
DEFAULT_RULE = "rejection"
Q_WIDTH = 32  # draft distributions keep at most this many tokens per position (the proposer's top ones)
Q_ROWS = 16  # draft positions whose q a remote drafter can share with the verifier (>= every method's k)
MIN_TEMPERATURE = 1e-5  # below it (and above 0) logits / T overflow: refused, as vLLM treats it as greedy
_WIRE_MIN_TEMPERATURE = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]  # 1e-5 as gRPC's float32 carries it

# Noise streams: one counter-based generator per (seed, stream), indexed by absolute position.
STREAM_TARGET = 0  # strict rule: the Gumbel noise of the target's sample (the drafter reuses it: coupling)
STREAM_DRAFT = 1  # rejection rule: the drafter's own sampling
STREAM_ACCEPT = 2  # rejection rule: the accept test (element 0) and the recovered / bonus sample (1..V)


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


def _check_finite(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise InvalidArgument(f"sampling.{name}", f"must be a number in {bound}, got {value}")


def validate(params: SamplingParams, vocab_size: int) -> SamplingParams:
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
    if params.seed is None and not params.greedy:
        params = replace(params, seed=secrets.randbits(63))
    return params


def from_pb(pb) -> SamplingParams:
    """blockspec.v1.SamplingParams -> SamplingParams (proto defaults mean "off"); validate afterwards."""
    return SamplingParams(
        temperature=pb.temperature, top_p=pb.top_p or 1.0, top_k=pb.top_k,
        seed=pb.seed if pb.HasField("seed") else None, rule=pb.rule or DEFAULT_RULE,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        presence_penalty=pb.presence_penalty, frequency_penalty=pb.frequency_penalty,
        no_repeat_ngram_size=pb.no_repeat_ngram_size, logit_bias=tuple(sorted(pb.logit_bias.items())),
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


def _banned_ngram_tokens(context: np.ndarray, n: int) -> np.ndarray:
    """Tokens that would complete an n-gram already in `context` (HF no_repeat_ngram_size)."""
    if len(context) < n:
        return context[:0]
    windows = np.lib.stride_tricks.sliding_window_view(context, n)  # [L - n + 1, n]
    hits = (windows[:, :-1] == context[len(context) - n + 1 :]).all(axis=1)
    return windows[hits, -1]


def process(logits: torch.Tensor, history: Sequence[int], prompt_len: int, drafts: Sequence[int],
            params: SamplingParams) -> torch.Tensor:
    """Apply the logits processors. logits [n, V]: row i follows history + drafts[:i] (n <= len(drafts) + 1).

    Order: repetition penalty (prompt + output), presence / frequency penalties (output only),
    no-repeat-n-gram ban, logit bias. Returns fp32 [n, V].
    """
    out = logits.float().clone()
    if not params.has_processors:
        return out
    n, vocab = out.shape
    hist = torch.as_tensor(list(history), dtype=torch.long)
    # extra[i]: counts of drafts[:i], the tokens row i sees beyond the committed history.
    extra = torch.zeros(n, vocab)
    if n > 1:
        extra[torch.arange(1, n), torch.as_tensor(list(drafts[: n - 1]), dtype=torch.long)] = 1.0
        extra = extra.cumsum(0)
    if params.repetition_penalty != 1.0:
        seen = (torch.bincount(hist, minlength=vocab)[:vocab].float() + extra) > 0
        penalized = torch.where(out < 0, out * params.repetition_penalty, out / params.repetition_penalty)
        out = torch.where(seen, penalized, out)
    if params.presence_penalty or params.frequency_penalty:
        generated = torch.bincount(hist[prompt_len:], minlength=vocab)[:vocab].float() + extra
        out = out - params.presence_penalty * (generated > 0) - params.frequency_penalty * generated
    if params.no_repeat_ngram_size:
        context = np.asarray(list(history) + list(drafts[: n - 1]), dtype=np.int64)
        for i in range(n):
            banned = _banned_ngram_tokens(context[: len(history) + i], params.no_repeat_ngram_size)
            out[i, torch.from_numpy(banned)] = -math.inf
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        out[:, list(ids)] += torch.tensor(bias)
    return out


def log_probs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p [n, V] (fp64) after temperature, top-k and top-p (HF semantics); -inf outside the kept set."""
    z = processed.double() / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = z.topk(params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if params.top_p < 1.0:
        ordered, order = z.sort(dim=-1)  # ascending
        drop = ordered.softmax(-1).cumsum(-1) <= 1.0 - params.top_p
        drop[..., -1] = False  # always keep the most likely token
        z = z.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return z.log_softmax(-1)


def uniforms(seed: int, position: int, stream: int, n: int) -> torch.Tensor:
    """n uniforms in (0, 1) (fp64) from a counter-based generator keyed by (seed, stream) at `position`.

    Philox: the position sits in the counter's third word, so positions never share random numbers, and
    a sample depends only on (seed, stream, position), not on how the text was produced.
    """
    bits = np.random.Philox(key=(seed % 2**64) + (stream << 64), counter=position << 128)
    u = np.random.Generator(bits).random(n)
    return torch.from_numpy(np.maximum(u, np.finfo(np.float64).tiny))


def gumbel(seed: int, position: int, stream: int, n: int, offset: int = 0) -> torch.Tensor:
    """Gumbel(0, 1) noise [n] (fp64); argmax(log p + noise) is an exact sample of p."""
    u = uniforms(seed, position, stream, offset + n)[offset:]
    return -torch.log(-torch.log(u))


def sample(logp: torch.Tensor, seed: int, position: int, stream: int, offset: int = 0) -> int:
    """Gumbel-max sample of one row of log-probabilities [V]."""
    return int((logp + gumbel(seed, position, stream, logp.shape[-1], offset)).argmax())


@dataclass(frozen=True)
class DraftDist:
    """The distribution q each draft token was sampled from, sparse: q rows over their top tokens."""

    token_ids: torch.Tensor  # [k, m] long
    probs: torch.Tensor  # [k, m] float; q of tokens outside a row is 0

    def head(self, k: int) -> DraftDist:
        return DraftDist(self.token_ids[:k], self.probs[:k])

    def dense(self, i: int, vocab_size: int) -> torch.Tensor:
        """Row i scattered onto the vocabulary [V] (fp64)."""
        return torch.zeros(vocab_size, dtype=torch.float64).index_add_(0, self.token_ids[i], self.probs[i].double())


@dataclass(frozen=True)
class DraftPick:
    index: int  # into the scores row
    probs: torch.Tensor | None  # [m] the distribution sampled from (rejection rule); None: deterministic pick


def draft_pick(scores: torch.Tensor, token_ids: torch.Tensor, params: SamplingParams, position: int,
               vocab_size: int) -> DraftPick:
    """Choose one draft token among scores [m] over token_ids [m] for the token at `position`.

    greedy: the best score. strict: the Gumbel-max with the target's own noise at that position, so a
    drafter close to the target picks the target's sample. rejection: a sample of q = softmax(scores / T)
    with the drafter's noise, q returned for the accept test.
    """
    if params.greedy:
        return DraftPick(int(scores.argmax()), None)
    scores, token_ids = scores.cpu(), token_ids.cpu()  # a GPU drafter's: the noise is drawn on the host
    z = scores.double() / params.temperature
    if params.rule == "strict":
        noise = gumbel(params.seed, position, STREAM_TARGET, vocab_size)[token_ids]
        return DraftPick(int((z + noise).argmax()), None)
    logq = z.log_softmax(-1)
    noise = gumbel(params.seed, position, STREAM_DRAFT, vocab_size)[token_ids]
    return DraftPick(int((logq + noise).argmax()), logq.exp().float())
