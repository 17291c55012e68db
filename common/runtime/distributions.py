"""The sampling maths on tensors: the logits processors and warpers that turn a target's logits into p, the
counter-based noise every sample draws from, and the draft distribution q a proposer samples from.

Used by plain decoding and by every verification rule (the verifier), and (noise, draft picks) by the proposers;
the parameters themselves are in sampling.py.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from blockspec.common.kernels import cpu_kernels
from blockspec.common.sampling import SamplingParams

# Noise streams: one counter-based generator per (seed, stream), indexed by absolute position.
STREAM_TARGET = 0  # strict rule: the Gumbel noise of the target's sample (the drafter reuses it: coupling)
STREAM_DRAFT = 1  # rejection rule: the drafter's own sampling
STREAM_ACCEPT = 2  # rejection rule: the accept test (element 0) and the recovered / bonus sample (1..V)
STREAM_SIBLING = 3  # rejection rule over a draft tree: the accept test of a node's child j >= 1 (element j - 1)
_WORD = 2**64 - 1
_local = threading.local()  # the noise generator of each thread (`uniforms`)


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
    no-repeat-n-gram ban, logit bias. Returns fp32 [n, V] (logits itself where no processor applies: not to be
    written to).
    """
    if not params.has_processors:
        return logits.float()  # read only from here on: no copy
    out = logits.float().clone()
    n, vocab = out.shape
    hist = torch.as_tensor(list(history), dtype=torch.long)
    # extra[i]: counts of drafts[:i], the tokens row i sees beyond the committed history.
    extra = torch.zeros(n, vocab)  # [n, V]
    if n > 1:
        extra[torch.arange(1, n), torch.as_tensor(list(drafts[: n - 1]), dtype=torch.long)] = 1.0
        extra = extra.cumsum(0)
    if params.repetition_penalty != 1.0:
        seen = (torch.bincount(hist, minlength=vocab)[:vocab].float() + extra) > 0  # [n, V]
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


def warped(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p cut the vocabulary (else p is softmax(logits / T) as it stands)."""
    return bool(params.top_k and params.top_k < vocab) or params.top_p < 1.0


def warp(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The scores z [n, V] (fp64) whose softmax is p: processed / T, -inf outside top-k and top-p (HF semantics)."""
    z = processed.double() / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = z.topk(params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if params.top_p < 1.0:
        ordered, order = z.sort(dim=-1)  # ascending
        drop = ordered.softmax(-1).cumsum(-1) <= 1.0 - params.top_p
        drop[..., -1] = False  # always keep the most likely token
        z = z.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return z


def log_probs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p [n, V] (fp64) after temperature, top-k and top-p (HF semantics); -inf outside the kept set."""
    return warp(processed, params).log_softmax(-1)


class LogProbRows:
    """p of a verify's rows as the rules read them, each row's work done when first needed: the rules stop at the
    first rejected draft, and rows after it are never touched. A row is its scores z = row / divisor, the scores below
    a floor cut, and their log-sum-exp, computed once where a probability is read; a sample needs no normaliser
    (`sample`: the Gumbel-max of z is the Gumbel-max of log p). On the CPU kernels the row is the processed logits
    themselves over T, never copied, and top-k / top-p are a floor found without sorting the row
    (`cpu_kernels.warp_floor`); elsewhere the row is `warp`'s. Row i equals log_probs of that row alone."""

    def __init__(self, processed: torch.Tensor, params: SamplingParams) -> None:
        self.processed, self.params = processed, params
        self._warped = warped(params, processed.shape[-1])
        self._scores: dict[int, tuple[torch.Tensor, float, float]] = {}
        self._lse: dict[int, float] = {}

    @property
    def shape(self) -> torch.Size:
        return self.processed.shape

    def scores(self, i: int) -> tuple[torch.Tensor, float, float]:
        """Row i's scores as (row, divisor, floor): z = row / divisor, -inf below floor."""
        if i not in self._scores:
            sp, row = self.params, self.processed[i]
            floor = cpu_kernels.warp_floor(row, sp.temperature, sp.top_k, sp.top_p) if self._warped else -math.inf
            if floor is not None:
                self._scores[i] = (row, sp.temperature, floor)
            else:  # no kernels: the warped row, made by torch
                self._scores[i] = (warp(self.processed[i : i + 1], sp)[0], 1.0, -math.inf)
        return self._scores[i]

    def lse(self, i: int) -> float:
        if i not in self._lse:
            row, divisor, floor = self.scores(i)
            fast = cpu_kernels.logsumexp(row, divisor, floor)
            self._lse[i] = fast if fast is not None else float(torch.logsumexp(self._z(i), -1))
        return self._lse[i]

    def _z(self, i: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """z of row i (at token_ids), fp64."""
        row, divisor, floor = self.scores(i)
        z = (row if token_ids is None else row.index_select(0, token_ids)).double() / divisor
        return z if floor == -math.inf else z.masked_fill(z < floor, -math.inf)

    def at(self, i: int, token_ids: torch.Tensor) -> torch.Tensor:
        """log p of row i at token_ids (fp64)."""
        return self._z(i, token_ids) - self.lse(i)

    def log_p(self, i: int, token: int) -> float:
        """log p of one token of row i: `at` for a single id, without the tensor ops."""
        row, divisor, floor = self.scores(i)
        z = float(row[token]) / divisor
        return z - self.lse(i) if z >= floor else -math.inf

    def __getitem__(self, i: int) -> torch.Tensor:
        """Row i whole ([V], fp64)."""
        return self._z(i) - self.lse(i)

    def sample(self, i: int, seed: int, position: int, stream: int, offset: int = 0) -> int:
        """`sample` of row i."""
        row, divisor, floor = self.scores(i)
        return sample(row, seed, position, stream, offset, divisor, floor)

    def sample_residual(self, i: int, q_ids: torch.Tensor, q_probs: torch.Tensor, seed: int, position: int,
                        stream: int, offset: int = 0) -> int:
        """`sample` of norm(max(0, p - q)) at row i, q over q_ids (a token listed twice counts its probabilities
        together) and zero elsewhere: log p with q's tokens replaced, not a pass over the vocabulary per term. Where
        the residual has no mass (p == q), a sample of p itself."""
        row, divisor, floor = self.scores(i)
        fast = cpu_kernels.residual_argmax(row, divisor, floor, self.lse(i), q_ids, q_probs, seed, position, stream,
                                           offset)
        if fast is not None:
            return fast
        ids, q_s = q_ids, q_probs.double()
        if len(set(ids.tolist())) < len(ids):
            ids, where = torch.unique(ids, return_inverse=True)
            q_s = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, where, q_s)
        p_s = self.at(i, ids).exp()
        z = self._z(i)
        if 1.0 - float(torch.minimum(p_s, q_s).sum()) > 0:  # sum(max(0, p - q)) = 1 - sum(min(p, q))
            z = z.index_copy(0, ids, (p_s - q_s).clamp(min=0).log() + self.lse(i))
        return sample(z, seed, position, stream, offset)


def uniforms(seed: int, position: int, stream: int, n: int) -> torch.Tensor:
    """n uniforms in (0, 1) (fp64) from a counter-based generator keyed by (seed, stream) at `position`.

    Philox: the position sits in the counter's third word, so positions never share random numbers, and
    a sample depends only on (seed, stream, position), not on how the text was produced.
    """
    return torch.from_numpy(_uniforms(seed, position, stream, n))


def _uniforms(seed: int, position: int, stream: int, n: int) -> np.ndarray:
    # One generator per thread, its state set for each call: the same numbers as a Philox made with this key and
    # counter, without the cost of making one (most of a sample's time where the vocabulary is small).
    gen = getattr(_local, "gen", None)
    if gen is None:
        gen = _local.gen = np.random.Generator(np.random.Philox(0))
    gen.bit_generator.state = {
        "bit_generator": "Philox",
        "state": {"counter": np.array([0, 0, position & _WORD, position >> 64], dtype=np.uint64),
                  "key": np.array([seed & _WORD, stream], dtype=np.uint64)},
        "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0,
    }
    return np.maximum(gen.random(n), np.finfo(np.float64).tiny)


def gumbel(seed: int, position: int, stream: int, n: int, offset: int = 0) -> torch.Tensor:
    """Gumbel(0, 1) noise [n] (fp64); argmax(log p + noise) is an exact sample of p."""
    u = uniforms(seed, position, stream, offset + n)[offset:]
    return -torch.log(-torch.log(u))


def gumbel_at(seed: int, position: int, stream: int, token_ids: torch.Tensor) -> torch.Tensor:
    """gumbel(seed, position, stream, V)[token_ids] for any V above the ids, computed at those tokens only: the
    generator's numbers come in order, so only those up to the largest id are drawn."""
    u = uniforms(seed, position, stream, int(token_ids.max()) + 1)[token_ids]
    return -torch.log(-torch.log(u))


def uniform(seed: int, position: int, stream: int, index: int = 0) -> float:
    """uniforms(seed, position, stream, index + 1)[index]: one number (in C++ where the CPU kernels run)."""
    fast = cpu_kernels.philox_uniform(seed, position, stream, index)
    return fast if fast is not None else float(uniforms(seed, position, stream, index + 1)[index])


def sample(scores: torch.Tensor, seed: int, position: int, stream: int, offset: int = 0, divisor: float = 1.0,
           floor: float = -math.inf) -> int:
    """Gumbel-max sample of a row of scores [V] (log-probabilities up to a constant): argmax(z + gumbel(seed, position,
    stream, V, offset)) for z = scores / divisor, -inf below floor. On the CPU one C++ loop
    (`cpu_kernels.gumbel_argmax`) computes the same argmax, drawing the noise of the tokens that could win only."""
    fast = cpu_kernels.gumbel_argmax(scores, seed, position, stream, offset, divisor, floor)
    if fast is not None:
        return fast
    z = scores.double() / divisor
    z = z if floor == -math.inf else z.masked_fill(z < floor, -math.inf)
    return int((z + gumbel(seed, position, stream, z.shape[-1], offset)).argmax())


@dataclass(frozen=True)
class DraftDist:
    """The distribution q each draft token was sampled from, sparse: q rows over their top tokens."""

    token_ids: torch.Tensor  # [k, m] long
    probs: torch.Tensor  # [k, m] float; q of tokens outside a row is 0

    def head(self, k: int) -> DraftDist:
        return DraftDist(self.token_ids[:k], self.probs[:k])



@dataclass(frozen=True)
class DraftPick:
    index: int  # into the scores row
    probs: torch.Tensor | None  # [m] the distribution sampled from (rejection rule); None: deterministic pick


def draft_pick(scores: torch.Tensor, token_ids: torch.Tensor, params: SamplingParams, position: int) -> DraftPick:
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
        noise = gumbel_at(params.seed, position, STREAM_TARGET, token_ids)
        return DraftPick(int((z + noise).argmax()), None)
    logq = z.log_softmax(-1)
    noise = gumbel_at(params.seed, position, STREAM_DRAFT, token_ids)
    return DraftPick(int((logq + noise).argmax()), logq.exp().float())


def walk_rows(params: Sequence[SamplingParams]) -> tuple[list[float], list[int], list[int], list[bool]]:
    """How each request's walk picks, per row: temperature (0: greedy, the best score), seed, noise stream (strict:
    the target's, the coupling; rejection: the drafter's own) and whether it keeps q (rejection). What `draft_pick`
    does for one row, for the batched walks (`WalkSampler`, the C++ walk)."""
    sampled = [None if p.greedy else p for p in params]
    return ([p.temperature if p else 0.0 for p in sampled], [p.seed if p else 0 for p in sampled],
            [(STREAM_TARGET if p.rule == "strict" else STREAM_DRAFT) if p else 0 for p in sampled],
            [bool(p) and p.rule == "rejection" for p in sampled])


class WalkSampler:
    """`draft_pick` for a batch of walks at once, with no transfer between the slots: the walk calls `begin` with every
    slot's candidates [R, S, m] (token ids) before its first pick, and then once per slot t with that slot's scores
    [R, K] (K >= m: the first m columns are the candidates'); back comes each row's index. The noise of every
    candidate is drawn on the host in one go (the candidates come over once) and moved to their device. Row r follows
    params[r], its slot t at position positions[r] + t: greedy the best of the first greedy_width scores (`begin`;
    None: all K); strict the argmax of z + g(STREAM_TARGET) with z = scores / T (fp64); rejection the argmax of
    log_softmax(z) + g(STREAM_DRAFT), q = softmax(z) kept for `q`. The numbers `draft_pick` draws, batched."""

    def __init__(self, params: Sequence[SamplingParams], positions: Sequence[int]) -> None:
        self.params, self.positions = list(params), list(positions)
        self.noise: torch.Tensor | None = None
        self._logq: list[torch.Tensor] = []

    def begin(self, candidates: torch.Tensor, greedy_width: int | None = None) -> None:
        self.candidates, self.greedy_width = candidates, greedy_width
        R, S, m = candidates.shape
        dev = candidates.device
        temps, row_seeds, row_streams, _ = walk_rows(self.params)
        self.greedy = torch.tensor([t == 0.0 for t in temps], device=dev)
        self.strict = torch.tensor([t > 0.0 and p.rule == "strict" for t, p in zip(temps, self.params)], device=dev)
        self.temps = torch.tensor([t or 1.0 for t in temps], dtype=torch.float64, device=dev)
        ids = candidates.cpu().reshape(R * S, m)
        seeds, streams = ([v for v in values for _ in range(S)] for values in (row_seeds, row_streams))
        positions = [first + t for first in self.positions for t in range(S)]
        noise = cpu_kernels.gumbel_rows(ids, seeds, streams, positions)
        if noise is None:
            noise = torch.zeros(R * S, m, dtype=torch.float64)
            for n in range(R * S):
                if temps[n // S]:
                    noise[n] = gumbel_at(seeds[n], positions[n], streams[n], ids[n])
        self.noise = noise.reshape(R, S, m).to(dev)
        self._logq = []

    def __call__(self, t: int, scores: torch.Tensor) -> torch.Tensor:
        m = self.noise.shape[-1]
        z = scores[:, :m].double() / self.temps[:, None]
        logq = z.log_softmax(-1)
        self._logq.append(logq)
        key = torch.where(self.strict[:, None], z, logq) + self.noise[:, t]
        return torch.where(self.greedy, scores[:, : self.greedy_width].argmax(-1), key.argmax(-1))

    def q(self) -> torch.Tensor:
        """q [R, S, m] (float32, on the host) of every slot picked so far: meaningful in the rejection rows."""
        return torch.stack(self._logq, 1).exp().float().cpu()
