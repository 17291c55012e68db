"""The contracts between router, drafter and verifier: the messages of a step and the protocols the roles satisfy.

The router steps through these types whether the roles run in its process or behind gRPC, so this module imports
no role and no torch (a draft distribution is only carried, never computed, here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from blockspec.common.sampling import GREEDY, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from blockspec.common.runtime.distributions import DraftDist

Q_WIDTH = 128  # a draft distribution keeps at most this many tokens per position (the proposer's top ones)
Q_ROWS = 16  # draft positions whose q a remote drafter can share with the verifier (>= every method's k)


@dataclass(frozen=True)
class ProposeInput:
    request_id: str
    token_ids: Sequence[int]  # committed tokens, prompt included; the last one is the anchor
    k: int  # number of draft tokens wanted (the proposer may return fewer)
    sampling: SamplingParams = GREEDY  # how the request samples: drafts follow it


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree under the anchor, verified in one forward (runner.Segment.parents): several candidates
    for a position, each followed by its own continuation. Tokens come parents first, by depth; parents[i] is the index
    of token i's parent, -1 for the anchor. q (rejection rule): row 0 the distribution the anchor's children were
    drawn from, without replacement in their order, row i + 1 token i's children's (a leaf's row unused); None: the
    children are deterministic given the context (greedy, strict)."""

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    q: DraftDist | None = None

    def depths(self) -> list[int]:
        """Each token's depth (the anchor's children: 1)."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def children(self) -> list[list[int]]:
        """children[i + 1]: token i's children in their order; children[0]: the anchor's."""
        out: list[list[int]] = [[] for _ in range(len(self.token_ids) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def first_path(self) -> tuple[int, ...]:
        """The tokens of the path that takes each node's first child: the walk's own draft."""
        children, path, node = self.children(), [], 0
        while children[node]:
            path.append(self.token_ids[children[node][0]])
            node = children[node][0] + 1
        return tuple(path)

    def head(self, k: int) -> DraftTree:
        """The tokens at depth k at most (a prefix: tokens come by depth)."""
        n = sum(1 for d in self.depths() if d <= k)
        if n == len(self.token_ids):
            return self
        return DraftTree(self.token_ids[:n], self.parents[:n], self.q.head(n + 1) if self.q is not None else None)


@dataclass(frozen=True)
class Draft:
    """A request's draft for one step: what the drafter proposed, carried unchanged to the verifier."""

    token_ids: tuple[int, ...]  # at most k draft tokens (with a tree: its first path, each node's first child)
    # Rejection rule: the distribution each token was sampled from. None: the tokens are deterministic given the
    # context (greedy, strict, n-gram), which the rule treats as a one-hot q. Across processes it is the role
    # client's handle to where the drafter left it (services/router/roles.SharedQ); either way `head(n)` cuts it.
    q: DraftDist | None = None
    tree: DraftTree | None = None  # a draft tree (the proposer's `tree` setting); token_ids is then its first path

    def head(self, k: int) -> Draft:
        if self.q is None and len(self.token_ids) <= k:  # nothing to cut (the step loop's usual case)
            return self
        return Draft(self.token_ids[:k], self.q.head(k) if self.q is not None else None,
                     self.tree.head(k) if self.tree is not None else None)


NO_DRAFT = Draft(())  # a plain decoding step


@dataclass(frozen=True)
class VerifyInput:
    request_id: str
    draft: Draft = NO_DRAFT  # no tokens: a plain decoding step


@dataclass(frozen=True)
class VerifyResult:
    request_id: str
    num_accepted: int
    token_ids: tuple[int, ...]  # tokens committed by this step (prefill: the first token)
    eos: bool  # the last committed token ends the sequence
    committed_len: int  # prompt + generated tokens after this step
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token_ids where the request asks (SamplingParams.logprobs)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one verify step by batch size and query width (k + 1), as the verifier measures them."""

    batch_sizes: tuple[int, ...]  # increasing
    widths: tuple[int, ...]  # 1, 2, ..., max width
    seconds: tuple[tuple[float, ...], ...]  # [batch size][width]

    def verify_s(self, batch: int, width: int) -> float:
        """Seconds for `batch` requests at `width` (past the widest measured: the widest)."""
        return self.verify_row(batch)[min(max(width, 1), self.widths[-1]) - 1]

    def verify_row(self, batch: int) -> list[float]:
        """Seconds for `batch` requests at each measured width: linear in the batch size between the
        measured ones (and past the largest, along its last segment)."""
        sizes = self.batch_sizes
        if len(sizes) == 1:
            return [s * batch / sizes[0] for s in self.seconds[0]]
        hi = max(next((i for i, b in enumerate(sizes) if b >= batch), len(sizes) - 1), 1)
        frac = (batch - sizes[hi - 1]) / (sizes[hi] - sizes[hi - 1])
        return [max(lo + frac * (up - lo), 0.0) for lo, up in zip(self.seconds[hi - 1], self.seconds[hi])]


class Proposer(Protocol):
    """Proposes draft tokens for a batch of requests. State is per request id; `release` drops it.

    A propose for a committed context the proposer has already seen must be idempotent (a retry).
    """

    method: str
    max_k: int

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]: ...

    def release(self, request_id: str) -> None: ...


class DrafterRole(Protocol):
    """What the step loop needs of a drafter: a local proposer or the router's client of a remote one."""

    max_k: int
    fallbacks: int  # requests that stepped at k = 0 because the drafter failed (a local proposer: always 0)

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]: ...

    def release(self, request_id: str) -> None: ...


class VerifierRole(Protocol):
    """What the step loop needs of a verifier: the local one or the router's client of a remote one."""

    num_slots: int
    free_slots: int
    num_blocks: int
    block_size: int
    free_blocks: int  # blocks requests can take now (free, or cached and evictable)

    def add(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, salt: str = "",
            prompt_len: int | None = None) -> object: ...

    def blocks_needed(self, request_id: str, tokens: int) -> int: ...

    def prefill(self, request_ids: Sequence[str], budget: int | None = None) -> list[VerifyResult]: ...

    def verify(self, inputs: Sequence[VerifyInput]) -> list[VerifyResult]: ...

    def release(self, request_id: str) -> None: ...

    def measure_step_costs(self, max_width: int) -> StepCosts: ...
