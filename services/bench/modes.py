"""What `blockspec bench` measures and reports: the modes it parses from --modes and the row each pass gives."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from blockspec.common.config import MAX_LOOKUP_TOKENS
from blockspec.common.errors import InvalidArgument

ENGINE_METHODS = ("none", "ngram", "draft_model", "dflash")
HF_MODES = ("hf", "hf-lookup", "hf-assisted", "hf-assisted-default")


@dataclass(frozen=True)
class Mode:
    """One thing to measure: an engine method with k, or a transformers baseline."""

    name: str  # "none", "dflash", "hf-lookup", ...
    k: int = 0
    adaptive: bool = False  # engine methods: adaptive k (k is the maximum)
    replay: bool = False  # engine methods: the drafts of an untimed run given back at no cost (ReplayProposer)
    lookup: bool = False  # engine methods: prompt lookup first, the drafter for the rest (StepLoop.prompt_lookup)
    lookup_tokens: int | None = None  # ... drafting this many tokens (`lookupN`; None: k)
    tree: tuple[int, ...] = ()  # dflash: a draft tree's children per node by depth (`tree3x2`: Engine's draft_tree)

    @property
    def label(self) -> str:
        """As the report's rows write it (their mode is name + flag): "dflash lookup k=7"."""
        return self.name + self.flag + (f" k={self.k}" if self.k else "")

    @property
    def flag(self) -> str:
        lookup = f" lookup{self.lookup_tokens or ''}" if self.lookup else ""
        tree = f" tree{'x'.join(map(str, self.tree))}" if self.tree else ""
        return lookup + tree + (" adaptive" if self.adaptive else " replay" if self.replay else "")


FLAGS = ("adaptive", "replay", "lookup")
_LOOKUP_N = re.compile(r"lookup[0-9]+")
_TREE = re.compile(r"tree[1-9][0-9]*(x[1-9][0-9]*)*")
SERVER = Mode("server")  # `bench --server`'s rows: Mode("server", k), k = 0 plain decoding (the baseline)


def parse_modes(text: str) -> list[Mode]:
    """"none,dflash:3,dflash:7:adaptive,dflash:7:replay,dflash:7:lookup,dflash:5:tree3x2,ngram:5,hf,hf-lookup:5" ->
    modes."""
    modes = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, rest = item.partition(":")
        k, *flags = rest.split(":")
        trees = [tuple(map(int, f.removeprefix("tree").split("x"))) for f in flags if _TREE.fullmatch(f)]
        if trees and (name != "dflash" or len(flags) > 1):
            raise InvalidArgument("--modes", f"{item!r}: a draft tree (':treeN', ':treeNxM...': children per node "
                                             "by depth) goes with dflash alone, without other flags")
        flags = [f for f in flags if not _TREE.fullmatch(f)]
        tokens = [f.removeprefix("lookup") for f in flags if _LOOKUP_N.fullmatch(f)]
        takes_k = name not in ("none", "hf")
        flags = ["lookup" if _LOOKUP_N.fullmatch(f) else f for f in flags]
        if name not in ENGINE_METHODS + HF_MODES:
            raise InvalidArgument("--modes", f"unknown mode {name!r}; use {', '.join(ENGINE_METHODS + HF_MODES)}")
        known = name in ENGINE_METHODS and all(f in FLAGS for f in flags) and len(set(flags)) == len(flags)
        # replay needs a drafter, lookup a model drafter (ngram is a lookup already); adaptive excludes replay
        fits = (name != "none" or "replay" not in flags) and (name in ("draft_model", "dflash") or "lookup" not in flags)
        # adaptive k's widths stop at k + 1: no lookupN with it
        bad_tokens = any(not 1 <= int(t) <= MAX_LOOKUP_TOKENS for t in tokens) or (tokens and "adaptive" in flags)
        if flags and not (known and fits and not {"adaptive", "replay"} <= set(flags)) or bad_tokens:
            raise InvalidArgument("--modes", f"{item!r}: engine methods take ':adaptive' or ':replay', and those with a "
                                             "model drafter ':lookup' or ':lookupN' (N: 1.."
                                             f"{MAX_LOOKUP_TOKENS} tokens a lookup drafts, not with adaptive) too "
                                             "(e.g. dflash:7:lookup:adaptive, dflash:7:lookup16)")
        try:
            if k and not k.isascii():  # int() reads other scripts' digits too
                raise ValueError(k)
            modes.append(Mode(name, int(k) if k else 0, "adaptive" in flags, "replay" in flags, "lookup" in flags,
                              int(tokens[0]) if tokens else None, trees[0] if trees else ()))
        except ValueError:
            raise InvalidArgument("--modes", f"{item!r}: k must be an integer") from None
        if takes_k and modes[-1].k < 1:
            raise InvalidArgument("--modes", f"{item!r}: give k of at least 1, e.g. {name}:5")
        if not takes_k and k:
            raise InvalidArgument("--modes", f"{item!r}: {name} takes no k")
    return modes


@dataclass
class Row:
    mode: str
    k: int
    concurrency: int
    tokens: int
    elapsed_s: float
    tokens_per_s: float
    tau: float | None = None
    acceptance_rate: float | None = None
    accepted_per_pos: list[int] = field(default_factory=list)
    steps: int = 0
    exact: bool | None = None  # outputs equal plain decoding's, token for token
    speedup: float | None = None  # tokens/s over plain decoding at the same concurrency
    rounds: list[float] = field(default_factory=list)  # tokens/s of every pass (the row is the median pass)
    # Concurrency 1, engine modes: ms per step [whole step, verify, drafter], from the step loop's own timers
    step_ms: list[float] = field(default_factory=list)
    looked_up: float | None = None  # `lookup` modes: the share of request-steps drafted by prompt lookup
    # Latency (engine and server modes): time to first token, the median request's and the 99th percentile (the
    # engine's: from admission, without the wait for a slot), and time per output token after the first (decode
    # time / tokens: over all requests, and the 99th percentile of the requests' own)
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    # Inter-token latency: the time between two consecutive chunks of a stream (a step's tokens arrive together),
    # all streams' gaps pooled: the median and the 99th percentile
    itl_ms: float | None = None
    itl_p99_ms: float | None = None
    request_rate: float | None = None  # open-loop passes (bench_rate): requests per second; concurrency is the cap
    tpot_rounds: list[float] = field(default_factory=list)  # TPOT of every pass, in the order of `rounds`
