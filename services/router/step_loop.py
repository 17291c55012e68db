"""The step loop: admit and prefill requests, then propose -> verify -> commit -> emit until each finishes."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from blockspec.common.contracts import (
    NO_DRAFT,
    Draft,
    DrafterRole,
    ProposeInput,
    VerifierRole,
    VerifyInput,
    VerifyResult,
)
from blockspec.common.sampling import GREEDY, SamplingParams, TokenLogprob
from blockspec.common.telemetry import tracing
from blockspec.common.tokens.lookup import ContextTexts, lookup
from blockspec.services.router.adaptive_k import AcceptanceTrace, AdaptiveK
from blockspec.services.router.kv_blocks import KvBlocks

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per step
# Prompt lookup in front of the drafter: the latest earlier match of the context's last 4, 3 or 2 tokens,
# continued periodically (common/tokens/lookup.py). On the default pair's prompts these draft better than 6..3, and
# 4..1 runs a little slower (a 1-token match drafts worse than the drafter).
LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM = 4, 2


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    k: int  # draft tokens per step; 0 = plain decoding
    sampling: SamplingParams = GREEDY  # validated, seed resolved (common/sampling.checked)
    span_context: tracing.SpanContext | None = None  # the request's span: step spans link to it
    cache_salt: str = ""  # its prefix cache blocks are shared with requests of the same salt only (the tenant's)


@dataclass(frozen=True)
class Load:
    """The step loop's requests at one moment, for the load gauges."""

    running: int
    waiting: int  # queued for a slot or still being prefilled
    slots: int  # verifier KV cache slots held: running or being prefilled
    kv_usage: float = 0.0  # share of the verifier's KV cache blocks held by requests (cached, unheld ones are free)


@dataclass
class RequestStats:
    steps: int = 0  # verify rounds after the prefill
    drafted: int = 0  # draft tokens sent to the verifier
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: steps whose draft position i was accepted
    preempted: int = 0  # times its blocks were taken back for others (it resumed where it stood)
    looked_up: int = 0  # steps drafted by prompt lookup (StepLoop.prompt_lookup), not by the drafter
    draft_s: float = 0.0
    verify_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)  # submitted
    queued_s: float = 0.0  # submitted -> admitted (a slot free, its prefill starting)
    first_token_s: float = 0.0  # submitted -> first token (queued_s included)
    elapsed_s: float = 0.0  # submitted -> finished

    @property
    def tau(self) -> float:
        """Tokens committed per step: accepted + 1 on average."""
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted > len(self.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


@dataclass(frozen=True)
class StepReport:
    """What one step did, summed over its requests (for metrics and traces)."""

    batch_size: int
    k: int  # the largest k of the step: asked of the drafter, or a lookup's draft (prompt_lookup_tokens)
    mean_k: float  # k per request, averaged over the batch (adaptive k lowers it)
    drafts: int  # requests that had a non-empty draft
    draft_tokens: int
    accepted_tokens: int
    draft_s: float
    verify_s: float
    fallback: bool  # the drafter failed during this step: its requests ran at k = 0
    accepted_per_pos: tuple[int, ...]  # [i]: requests whose draft position i was accepted
    looked_up: int = 0  # requests drafted by prompt lookup, not by the drafter


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token where the request asks (SamplingParams.logprobs)


@dataclass(frozen=True)
class FinishEvent:
    request_id: str
    reason: str  # "stop" (end-of-sequence token), "length" (max_tokens) or "cancelled"
    token_ids: tuple[int, ...]  # every generated token
    stats: RequestStats


@dataclass
class _Live:
    request: Request
    token_ids: list[int]  # prompt + generated
    stats: RequestStats
    trace: AcceptanceTrace = field(default_factory=AcceptanceTrace)  # adaptive k: the drafter's acceptance per position
    lookup_trace: AcceptanceTrace = field(default_factory=AcceptanceTrace)  # ... and prompt lookup's
    last_drafted: int = 0  # drafts of its last step (0 after the prefill): 0 means the drafter has context to catch up
    admitted: int = 0  # admission order: the latest admitted is preempted first

    @property
    def generated(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_ids)


class StepLoop(KvBlocks):
    """Steps all running requests together (one propose, one verify); new requests join between steps.

    Not thread-safe: call submit / cancel / step from one thread (the server runs them on one executor).
    """

    def __init__(self, verifier: VerifierRole, drafter: DrafterRole, max_batch: int, adaptive_k: bool = False,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, prompt_lookup: bool = False,
                 prompt_lookup_tokens: int | None = None) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.max_batch = max_batch
        # Prompt lookup first: a request whose context repeats itself gets the continuation of the repeat
        # as its draft, and the drafter is asked only for the others (none: the drafter drafts every request).
        self.prompt_lookup = prompt_lookup and drafter.max_k > 0
        # Draft tokens of a looked-up request running alone (None: the step's k, as the drafter's). More than the
        # drafter's block can draft where the context loops; without adaptive k only (its verify table stops at
        # max_k + 1).
        self.lookup_tokens = prompt_lookup_tokens if prompt_lookup_tokens and not adaptive_k else None
        if prompt_lookup_tokens and adaptive_k:
            log.warning("prompt_lookup_tokens %d is ignored with adaptive k: lookups draft the chosen k", prompt_lookup_tokens)
        self._texts = ContextTexts()  # prompt lookup's text of each running request
        # Adaptive k starts from the verifier's own step costs, measured now (before any request).
        self.adaptive = AdaptiveK(verifier.measure_step_costs(drafter.max_k + 1)) if adaptive_k and drafter.max_k else None
        self._last_verified: float | None = None  # end of the last verify; the time to the next step is overhead
        self._prefilled = False  # this step prefilled: its extra time is not step overhead
        self.prefill_chunk = prefill_chunk  # prompt tokens prefilled per step (None: whole prompts at once)
        self._waiting: deque[_Live] = deque()
        self._prefilling: dict[str, _Live] = {}  # holding a slot, prompt partly in the cache
        self._running: dict[str, _Live] = {}
        self._unsent: list[TokenEvent | FinishEvent] = []  # the events of the step's part under way (_phases)
        self.last_report: StepReport | None = None
        self._admissions = 0
        self.preemptions = 0  # requests whose blocks were taken back, since the start

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._prefilling and not self._running

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Queued for a slot or still being prefilled."""
        return len(self._waiting) + len(self._prefilling)

    @property
    def load(self) -> "Load":
        v = self.verifier
        return Load(len(self._running), self.num_waiting, len(self._running) + len(self._prefilling),
                    1 - v.free_blocks / v.num_blocks)

    def submit(self, request: Request) -> None:
        """Queue a request; it is prefilled at the next step with a free slot."""
        self._waiting.append(_Live(request, list(request.prompt_ids), RequestStats()))

    def cancel(self, request_id: str) -> FinishEvent | None:
        """Drop a request wherever it is and free its slots in both roles."""
        live = self._running.pop(request_id, None) or self._prefilling.pop(request_id, None)
        if live is None:
            live = next((lv for lv in self._waiting if lv.request.request_id == request_id), None)
            if live is None:
                return None
            self._waiting.remove(live)
            return self._finish(live, "cancelled")
        try:
            self._release(request_id)
        except Exception:  # a role that cannot release (down, restarting): the request ends all the same
            log.exception("releasing request %s failed; ending it anyway (a role may keep its slot)", request_id)
        return self._finish(live, "cancelled")

    def cancel_all(self) -> list[FinishEvent]:
        """Cancel every request wherever it is (a failed step: none can go on), a failed release included."""
        events = [e for e in self._handed_on() if isinstance(e, FinishEvent)]  # finished in the failed step
        for rid in [lv.request.request_id for lv in self._waiting] + [*self._prefilling, *self._running]:
            event = self.cancel(rid)
            if event is not None:
                events.append(event)
        return events

    def step(self, emit: Callable[[list[TokenEvent | FinishEvent]], None] | None = None) -> list[TokenEvent | FinishEvent]:
        """Admit and prefill what fits, then one propose -> verify -> commit round for the running requests.
        emit: called with the first tokens of the prompts prefilled in this step before the round runs (a server
        streams them at once, a round later otherwise); without it they come first in the step's events."""
        phases = self._phases()
        events = next(phases)
        if emit is not None and events:
            emit(events)
            events = []
        try:
            return events + next(phases)
        except Exception:
            self._unsent[:0] = events  # not handed on: cancel_all ends what they finished
            raise

    def run(self, requests: Iterable[Request]) -> Iterator[TokenEvent | FinishEvent]:
        """Submit all requests and step until every one has finished; first tokens as soon as they are known."""
        for request in requests:
            self.submit(request)
        while not self.idle:
            for events in self._phases():
                yield from events

    def _phases(self) -> Iterator[list[TokenEvent | FinishEvent]]:
        """One step in two parts: the first tokens of the prompts prefilled now, then the round's events (each list
        whole before it is handed on: a caller may cancel between two events). Each part collects its events in
        `_unsent` as it makes them: if it fails midway, cancel_all still ends the requests it finished."""
        self._unsent = []
        self._admit()
        yield self._handed_on()
        for event in self._step() if self._running else ():
            self._unsent.append(event)
        yield self._handed_on()

    def _handed_on(self) -> list[TokenEvent | FinishEvent]:
        events, self._unsent = self._unsent, []
        return events

    def _admit(self) -> None:
        """Take queued requests while slots and KV blocks allow and prefill (chunked: at most prefill_chunk prompt
        tokens per step, so running streams keep going); the events of every prompt now complete (its first token)
        to `_unsent`. A request is admitted when the blocks of its whole context and one more are free beyond what
        the prompts under way still take (a prefix cache hit may need fewer: counted as if it did not)."""
        self.last_report = None
        v = self.verifier
        free = self._admission_blocks()
        while (self._waiting and len(self._running) + len(self._prefilling) < self.max_batch and v.free_slots):
            live = self._waiting[0]
            need = self._blocks_for(len(live.token_ids)) + 1
            if need > free and (self._running or self._prefilling):
                break  # it waits for blocks; alone it goes (the cache holds max_len tokens)
            free -= need
            self._waiting.popleft()
            if not live.stats.queued_s:
                live.stats.queued_s = time.perf_counter() - live.stats.started
            self._admissions += 1
            live.admitted = self._admissions
            self._prefilling[live.request.request_id] = live  # first: if the add fails, a failed step still ends it
            v.add(live.request.request_id, live.token_ids, live.request.sampling, live.request.cache_salt,
                  len(live.request.prompt_ids))
        self._prefilled = bool(self._prefilling)
        if self._prefilling:
            for result in v.prefill(list(self._prefilling), self.prefill_chunk):
                live = self._running[result.request_id] = self._prefilling.pop(result.request_id)
                if not live.stats.first_token_s:
                    live.stats.first_token_s = time.perf_counter() - live.stats.started
                self._unsent.extend(self._commit(live, result))
            self._make_room({})  # prompts under way that found too few blocks

    def _k(self, live: _Live) -> int:
        # Never draft past max_tokens: a step commits at most k + 1 tokens.
        remaining = live.request.max_tokens - live.generated
        return max(0, min(live.request.k, self.drafter.max_k, remaining - 1))

    def _plan(self, lives: list[_Live]) -> tuple[list[ProposeInput], dict[str, Draft], float]:
        """Each request's k (adaptive k's choice, else the requested one; a looked-up request's: its draft's),
        prompt lookup's drafts and the seconds the lookup took."""
        wants = [ProposeInput(lv.request.request_id, lv.token_ids, self._k(lv), lv.request.sampling) for lv in lives]
        started = time.perf_counter()
        looked_up = self._looked_up(self._lookup_wants(lives, wants)) if self.prompt_lookup else {}
        lookup_s = time.perf_counter() - started
        if self.lookup_tokens:  # the looked-up requests verify their whole draft
            wants = [dataclasses.replace(w, k=len(looked_up[w.request_id].token_ids)) if w.request_id in looked_up
                     else w for w in wants]
        if self.adaptive:
            hits = [w.request_id in looked_up for w in wants]
            traces = [(lv.lookup_trace if hit else lv.trace, w.k) for lv, w, hit in zip(lives, wants, hits)]
            ks = self.adaptive.choose(traces, hits if looked_up else None)
            wants = [dataclasses.replace(w, k=k) for w, k in zip(wants, ks)]
            looked_up = {w.request_id: looked_up[w.request_id].head(w.k)
                         for w in wants if w.k and w.request_id in looked_up}
        return wants, looked_up, lookup_s

    def _step(self) -> Iterator[TokenEvent | FinishEvent]:
        lives = list(self._running.values())
        wants, looked_up, lookup_s = self._plan(lives)  # the lookup's time counts as drafting
        span = tracing.step_span([lv.request.span_context for lv in lives]) if tracing.recording() else None
        # The role calls carry the step span as their parent.
        with tracing.use_span(span) if span is not None else contextlib.nullcontext():
            fallbacks = self.drafter.fallbacks
            t0 = time.perf_counter()
            drafted = dict(looked_up)
            to_draft = [w for w in wants if w.k > 0 and w.request_id not in looked_up]
            if to_draft:
                drafted.update(zip((w.request_id for w in to_draft), self.drafter.propose(to_draft)))
            t1 = time.perf_counter()
            inputs = [VerifyInput(w.request_id, drafted[w.request_id].head(w.k) if w.request_id in drafted else NO_DRAFT)
                      for w in wants]
            # each verify's positions: the anchor and its drafts (a draft tree's every node)
            self._make_room({i.request_id: 1 + len((i.draft.tree or i.draft).token_ids) for i in inputs})
            if len(self._running) < len(lives):  # some were preempted: the step goes on without them
                lives = [lv for lv in lives if lv.request.request_id in self._running]
                wants = [w for w in wants if w.request_id in self._running]
                inputs = [i for i in inputs if i.request_id in self._running]
                looked_up = {r: d for r, d in looked_up.items() if r in self._running}
            results = self.verifier.verify(inputs)
            t2 = time.perf_counter()
            draft_s = t1 - t0 + lookup_s
            report = self.last_report = self._report(wants, inputs, results, draft_s, t2 - t1,
                                                     self.drafter.fallbacks > fallbacks, len(looked_up))
            if span is not None:
                tracing.set_step_attributes(span, report)
        if self.adaptive:
            overhead = None if self._last_verified is None or self._prefilled else t0 - self._last_verified - lookup_s
            width = max(len(i.draft.token_ids) + 1 for i in inputs)
            asked = {w.request_id for w in to_draft}
            caught_up = any(lv.last_drafted == 0 for lv in lives if lv.request.request_id in asked)
            self.adaptive.observe_step(len(inputs), width, t2 - t1, draft_s, overhead, caught_up, drafted=len(to_draft))
        self._last_verified = t2
        for live, inp, result in zip(lives, inputs, results):
            hit = inp.request_id in looked_up
            live.last_drafted = 0 if hit else len(inp.draft.token_ids)  # 0: the drafter has context to catch up
            if self.adaptive:
                self.adaptive.observe_request(live.lookup_trace if hit else live.trace, len(inp.draft.token_ids),
                                              result.num_accepted, hit)
            live.stats.record(len(inp.draft.token_ids), result.num_accepted)
            live.stats.looked_up += hit
            live.stats.draft_s += draft_s
            live.stats.verify_s += t2 - t1
            yield from self._commit(live, result)

    @staticmethod
    def _report(wants: list[ProposeInput], inputs: list[VerifyInput], results: list[VerifyResult], draft_s: float,
                verify_s: float, fallback: bool, looked_up: int) -> StepReport:
        per_pos = [0] * max((len(i.draft.token_ids) for i in inputs), default=0)
        for r in results:
            for i in range(r.num_accepted):
                per_pos[i] += 1
        return StepReport(
            batch_size=len(inputs), k=max((w.k for w in wants), default=0), mean_k=sum(w.k for w in wants) / len(wants),
            drafts=sum(1 for i in inputs if i.draft.token_ids), draft_tokens=sum(len(i.draft.token_ids) for i in inputs),
            accepted_tokens=sum(r.num_accepted for r in results), draft_s=draft_s, verify_s=verify_s, fallback=fallback,
            accepted_per_pos=tuple(per_pos), looked_up=looked_up)

    def _lookup_wants(self, lives: list[_Live], wants: list[ProposeInput]) -> list[ProposeInput]:
        """What each request asks of the lookup: its k, or `lookup_tokens` (within max_tokens) where set and the
        request runs alone. The verify pads every request to the widest draft, so in a batch a long lookup widens
        every request's verify: at concurrency 8 and 16, 16-token lookups gain little over plain decoding or lose
        to it, where lookups of k gain clearly."""
        if not self.lookup_tokens or len(lives) > 1:
            return wants  # at the requested k; adaptive k cuts it to the chosen one
        room = [lv.request.max_tokens - lv.generated - 1 for lv in lives]  # a step commits at most k + 1 tokens
        return [dataclasses.replace(w, k=min(self.lookup_tokens, r)) if w.k else w for w, r in zip(wants, room)]

    def _looked_up(self, wants: Sequence[ProposeInput]) -> dict[str, Draft]:
        """Prompt lookup's drafts: k tokens for each request whose context's suffix occurred before."""
        found = {}
        for w in wants:
            if w.k > 0:
                ids = lookup(w.token_ids, w.k, LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM, periodic=True,
                             text=self._texts.of(w.request_id, w.token_ids))
                if ids:
                    found[w.request_id] = Draft(ids)
        return found

    def _commit(self, live: _Live, result: VerifyResult) -> Iterator[TokenEvent | FinishEvent]:
        live.token_ids.extend(result.token_ids)
        rid = live.request.request_id
        if result.committed_len != len(live.token_ids):  # the verifier holds other tokens than the stream has sent
            raise RuntimeError(f"request {rid}: the verifier committed {result.committed_len} tokens, the step loop "
                               f"{len(live.token_ids)}")
        yield TokenEvent(rid, result.token_ids, result.logprobs)
        reason = "stop" if result.eos else "length" if live.generated >= live.request.max_tokens else None
        if reason is None:
            return
        self._release(rid)  # then forget it: if the release fails, a failed step still ends it
        del self._running[rid]
        yield self._finish(live, reason)

    def _release(self, request_id: str) -> None:
        """Free what the request holds in both roles and in prompt lookup: each, though another fails (the first
        failure is raised after)."""
        failed = None
        for release in (self.verifier.release, self.drafter.release, self._texts.drop):
            try:
                release(request_id)
            except Exception as e:  # noqa: BLE001 - raised below, once the others are free
                failed = failed or e
        if failed is not None:
            raise failed

    @staticmethod
    def _finish(live: _Live, reason: str) -> FinishEvent:
        live.stats.elapsed_s = time.perf_counter() - live.stats.started
        generated = tuple(live.token_ids[len(live.request.prompt_ids) :])
        return FinishEvent(live.request.request_id, reason, generated, live.stats)
