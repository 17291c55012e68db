"""Adaptive k: each step, the batch drafts the k that maximises its expected committed tokens per second.

Expected tokens of one request for k drafts: E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i, with a_i its
conditional acceptance at draft position i (EWMA of what the verifier judged). Positions a request
has not been judged at take the rates of all requests together (a slow EWMA), and its rates relax
towards those while it is not drafting. A position all requests together have judged fewer than
MIN_JUDGED times counts at least the position before it: one that is not drafted is never judged again.

Step time for width W = k + 1 at batch size B: verify(B, W) + draft(B, W) [W > 1] + overhead(B).
* verify comes from a table the verifier measured before serving (`Verifier.measure_step_costs`), scaled
  by an EWMA of observed / table time (how fast the machine runs now against calibration);
* draft is an EWMA of the drafter's observed time per (batch size, width), leaving out every step where
  a request drafts for the first time since its prefill or a plain step (the drafter then catches up the
  context it has not seen: a whole prompt, tens of rows, which made a width look dear for long);
* overhead is an EWMA of the rest of a step (the loop, the commit, the caller).
In these EWMAs one observation counts at most SPIKE x the estimate: a step the VM preempted moves it a little.

The verify forward pads every request to the widest one, so a step has one width: the chooser tries
W = 1 .. max + 1 and gives each request min(W - 1, its own k). From plain decoding, a width above 1
must beat plain decoding's estimated rate by DRAFT_MARGIN, a hedge against the estimates' error; a
batch already drafting keeps drafting while it is estimated at least as fast (STAY_MARGIN). W = 1 is
plain decoding: no drafter call. A batch held at W = 1 drafts one token every PROBE_EVERY steps, to
keep the shared rates fresh, unless drafting is estimated far from paying (a probe step costs a
drafter call and its catch-up).

With prompt lookup (router/step_loop.py) a request whose context repeats is drafted by the lookup, not the
drafter: its expected tokens come from its own lookup trace over all requests' lookup rates (another pair of
traces: a looked-up repeat is accepted far more often than a drafter's guess), and it adds nothing to the
drafter's time, which is kept per number of requests the drafter drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blockspec.common.contracts import StepCosts

ALPHA = 0.2  # EWMA weight of the newest observation (a request's acceptance, the costs)
PRIOR_ALPHA = 0.02  # the same for the acceptance of all requests together
RELAX = 0.2  # per step, how far a request's unjudged positions move towards all requests' rates
WARMUP_STEPS = 32  # steps at the requested k before choosing: acceptance and drafter time are observed, and
# the first drafter calls (a whole prompt of context to catch up) are forgotten by the EWMA
PRIOR_ACCEPTANCE = 0.5  # conditional acceptance assumed for a position never drafted
MIN_JUDGED = 20  # all requests' rate at a position judged fewer times counts at least the one before it: else a deep
# position judged a few times in the warm-up, mostly rejected, holds the chooser at a smaller k for good (not drafted,
# it is never judged again) where a larger k runs faster; on the default pair acceptance does not fall with depth
PROBE_EVERY = 64  # a batch held at k = 0 drafts one token every this many steps (refreshes the prior) ...
PROBE_MARGIN = 0.8  # ... when drafting is estimated to give at least this share of plain decoding's rate
DRAFT_MARGIN = 1.15  # a batch at plain decoding starts drafting only when that is estimated this much faster ...
STAY_MARGIN = 1.0  # ... and a drafting batch keeps drafting while it is estimated at least this fast (hysteresis:
# each return to drafting makes the drafter catch up the context it skipped)
SPIKE = 2.0  # a step's cost counts at most this multiple of its estimate: a preempted step (many times the drafter's
# usual time) must not make a width look dear for long, as it is not observed again while not chosen


def _ewma(old: float | None, new: float) -> float:
    """A cost's EWMA; an observation above SPIKE x the estimate counts as SPIKE x."""
    return new if old is None else (1 - ALPHA) * old + ALPHA * min(new, SPIKE * old)


@dataclass
class AcceptanceTrace:
    """Conditional acceptance per draft position (EWMA): one request's (fast), or all requests' (slow)."""

    rates: list[float] = field(default_factory=list)
    alpha: float = ALPHA
    mean_first: bool = False  # a plain mean (the starting guess one term) up to 1 / alpha observations
    counts: list[int] = field(default_factory=list)  # observations per position
    _floored: dict[int, float] = field(default_factory=dict, repr=False, compare=False)  # `rate` since the last observe

    def observe(self, drafted: int, accepted: int, prior: "AcceptanceTrace | None" = None) -> None:
        """One verify of `drafted` drafts, `accepted` of them accepted. Positions the verifier did not judge
        this step move towards the prior by RELAX: a request held at k = 0 drifts back to what drafting
        gives on average, so it tries again, soon if drafting usually pays."""
        self._floored.clear()
        judged = min(drafted, accepted + 1)
        for i in range(judged):
            hit = 1.0 if i < accepted else 0.0
            if i == len(self.rates):
                self.rates.append(self.rate(i, prior))
            weight = self.alpha
            if self.mean_first:
                self.counts += [0] * (len(self.rates) - len(self.counts))
                self.counts[i] += 1
                weight = max(weight, 1.0 / (self.counts[i] + 1))  # the starting guess counts as one
            self.rates[i] += weight * (hit - self.rates[i])
        if prior is not None:
            for i in range(judged, len(self.rates)):
                self.rates[i] += RELAX * (prior.rate(i) - self.rates[i])

    def rate(self, i: int, prior: "AcceptanceTrace | None" = None) -> float:
        """Conditional acceptance at position i: this trace's, else the prior's, else the last one known.
        A trace that counts its observations (all requests') takes a position judged fewer than MIN_JUDGED
        times at no less than the position before it: optimism for what has barely been tried."""
        if i < len(self.rates):
            own = self.rates[i]
        elif prior is not None:
            return prior.rate(i)
        else:
            own = self.rates[-1] if self.rates else PRIOR_ACCEPTANCE
        if self.mean_first and i > 0 and (i >= len(self.counts) or self.counts[i] < MIN_JUDGED):
            floored = self._floored.get(i)
            if floored is None:
                floored = self._floored[i] = max(own, self.rate(i - 1))
            return floored
        return own

    def expected_tokens(self, k: int, prior: "AcceptanceTrace | None" = None) -> float:
        return self.expected_tokens_upto(k, prior)[k]

    def expected_tokens_upto(self, k: int, prior: "AcceptanceTrace | None" = None) -> list[float]:
        """[E(0), E(1), ..., E(k)] in one pass."""
        totals, p = [1.0], 1.0
        for i in range(k):
            p *= self.rate(i, prior)
            totals.append(totals[-1] + p)
        return totals


class AdaptiveK:
    """Chooses the k of every request of a step; fed with every step's timings."""

    def __init__(self, costs: StepCosts) -> None:
        self.costs = costs
        self.steps = 0
        self.speed: float | None = None  # observed verify time / table time (EWMA)
        self.draft_s: dict[tuple[int, int], float] = {}  # (batch, width) -> drafter seconds (EWMA)
        self.overhead_s: dict[int, float] = {}  # batch -> seconds of a step outside draft and verify (EWMA)
        self.steps_at_one = 0  # consecutive steps at width 1
        self.last_width = 0  # the width this chooser last picked (0 before its first choice, after warm-up)
        self._verify_rows: dict[int, list[float]] = {}  # batch size -> the verify table's row for it
        self.prior = AcceptanceTrace(alpha=PRIOR_ALPHA, mean_first=True)  # every request's observations, slowly
        self.lookup_prior = AcceptanceTrace(alpha=PRIOR_ALPHA, mean_first=True)  # the same for prompt lookup's drafts

    def observe_request(self, trace: AcceptanceTrace, drafted: int, accepted: int, looked_up: bool = False) -> None:
        """Every request of every step, k = 0 included; `trace` the request's drafter trace, or its lookup
        trace where prompt lookup drafted it (`looked_up`)."""
        prior = self.lookup_prior if looked_up else self.prior
        prior.observe(drafted, accepted)
        trace.observe(drafted, accepted, prior)

    def observe_step(self, batch: int, width: int, verify_s: float, draft_s: float, overhead_s: float | None,
                     caught_up: bool = False, drafted: int | None = None) -> None:
        """One finished step: `width` is the widest row verified; overhead None when unknown (first step);
        caught_up: a request drafted for the first time since its prefill or a plain step, so draft_s
        includes its skipped context and is not the drafter's usual time; drafted: the requests the drafter
        drafted (None: all `batch`; fewer where prompt lookup drafted the others, none: no drafter time)."""
        self.steps += 1
        table = self._table_row(batch)
        self.speed = _ewma(self.speed, verify_s / max(table[min(width, len(table)) - 1], 1e-9))
        drafted = batch if drafted is None else drafted
        if width > 1 and drafted and not caught_up:
            self.draft_s[drafted, width] = _ewma(self.draft_s.get((drafted, width)), draft_s)
        if overhead_s is not None:
            self.overhead_s[batch] = _ewma(self.overhead_s.get(batch), max(overhead_s, 0.0))

    def _draft_estimate(self, batch: int, width: int) -> float:
        if (batch, width) in self.draft_s:
            return self.draft_s[batch, width]
        if not self.draft_s:
            return self._table_row(batch)[0]  # never drafted: guess one target decode
        # Nearest batch size observed, then nearest width, scaled to this one: the drafter's block has
        # `width` rows per request (anchor and k masks).
        b, w = min(self.draft_s, key=lambda bw: (abs(bw[0] - batch), abs(bw[1] - width)))
        return self.draft_s[b, w] * batch / b * width / w

    def _table_row(self, batch: int) -> list[float]:
        row = self._verify_rows.get(batch)
        if row is None:
            row = self._verify_rows[batch] = self.costs.verify_row(batch)
        return row

    def step_seconds(self, batch: int, width: int) -> float:
        return self.step_row(batch, width)[width - 1]

    def step_row(self, batch: int, max_width: int, drafted: int | None = None) -> list[float]:
        """Estimated seconds of a step of `batch` requests at widths 1 .. max_width: the verify table's
        row (interpolated once per batch size) at the machine's speed, plus the drafter (for `drafted` of
        them; None: all) and the overhead."""
        row = self._table_row(batch)
        speed, last = self.speed or 1.0, len(row) - 1
        overhead = self.overhead_s.get(batch)
        if overhead is None:
            overhead = min(self.overhead_s.values(), default=0.0)
        drafted = batch if drafted is None else drafted
        return [row[min(w - 1, last)] * speed + overhead
                + (self._draft_estimate(drafted, w) if w > 1 and drafted else 0.0) for w in range(1, max_width + 1)]

    def choose(self, requests: list[tuple[AcceptanceTrace, int]], looked_up: list[bool] | None = None) -> list[int]:
        """k for each (trace, largest k allowed) of the step's batch; looked_up[i]: prompt lookup drafts
        request i (its trace is its lookup trace; the drafter is not asked for it)."""
        k_max = max((k for _, k in requests), default=0)
        if k_max <= 0 or self.steps < WARMUP_STEPS:
            return [k for _, k in requests]
        batch = len(requests)
        looked_up = looked_up or [False] * batch
        seconds = self.step_row(batch, k_max + 1, batch - sum(looked_up))
        plain_rate = batch / seconds[0]
        # Drafting must beat plain decoding by a margin: the estimates are off by 10-20% on a noisy machine.
        margin = STAY_MARGIN if self.last_width > 1 else DRAFT_MARGIN
        best, best_rate, drafting_rate = 1, plain_rate * margin, 0.0
        expected = [trace.expected_tokens_upto(k, self.lookup_prior if hit else self.prior)
                    for (trace, k), hit in zip(requests, looked_up)]
        for width in range(2, k_max + 2):
            tokens = sum(e[min(width - 1, len(e) - 1)] for e in expected)
            rate = tokens / seconds[width - 1]
            drafting_rate = max(drafting_rate, rate)
            if rate > best_rate:
                best, best_rate = width, rate
        self.steps_at_one = self.steps_at_one + 1 if best == 1 else 0
        # Held at plain decoding, probe now and then, only where drafting is estimated close to paying.
        if self.steps_at_one > PROBE_EVERY and drafting_rate >= PROBE_MARGIN * plain_rate:
            best, self.steps_at_one = 2, 0
        self.last_width = best
        return [min(best - 1, k) for _, k in requests]
