"""Adaptive k: each step, each request drafts the k that maximises its expected committed tokens per
unit of step time, from its recent acceptance per position and the step costs measured online.

Expected tokens for k drafts: E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i, with a_i the conditional
acceptance at position i (EWMA). Step time is fitted online as t = t0 + t_row * rows (+ t_d when the
drafter runs), rows = sum of (k + 1) over the batch; a request's share at batch size B is
t0 / B + t_row * (k + 1) + t_d / B * [k > 0]. k = 0 (plain decoding, no drafter call) wins when
drafting does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.2  # EWMA weight of the newest observation
WARMUP_STEPS = 8  # steps timed before the cost fit is trusted (the requested k is used until then)
PRIOR_ACCEPTANCE = 0.5  # conditional acceptance assumed for a position never drafted
PROBE_EVERY = 16  # a request held at k = 0 drafts one token every this many steps, to notice a change


@dataclass
class _Fit:
    """EWMA of step time against rows, split by whether the drafter ran."""

    n: int = 0
    mean_rows: float = 0.0
    mean_t: float = 0.0
    cov: float = 0.0
    var: float = 0.0
    draft_s: float = 0.0  # EWMA drafter time per step

    def observe(self, rows: int, verify_s: float, draft_s: float, drafted: bool) -> None:
        a = ALPHA if self.n else 1.0
        self.n += 1
        d_rows, d_t = rows - self.mean_rows, verify_s - self.mean_t
        self.mean_rows += a * d_rows
        self.mean_t += a * d_t
        self.cov = (1 - a) * (self.cov + a * d_rows * d_t)
        self.var = (1 - a) * (self.var + a * d_rows * d_rows)
        if drafted:
            self.draft_s = draft_s if not self.draft_s else (1 - ALPHA) * self.draft_s + ALPHA * draft_s

    def costs(self) -> tuple[float, float]:
        """(t0, t_row): intercept and per-row slope, the slope kept non-negative."""
        # Until the rows vary (every request at the same k, a steady batch) the slope is unknown: count it
        # as fixed cost, which is what a step costs on memory-bound hardware; it is learnt once rows vary.
        slope = max(self.cov / self.var, 0.0) if self.var > 0.25 else 0.0
        return max(self.mean_t - slope * self.mean_rows, 0.0), slope


@dataclass
class AcceptanceTrace:
    """One request's conditional acceptance per draft position (EWMA)."""

    rates: list[float] = field(default_factory=list)
    steps_at_zero: int = 0

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, accepted + 1)):  # positions the verifier actually judged
            hit = 1.0 if i < accepted else 0.0
            if i < len(self.rates):
                self.rates[i] = (1 - ALPHA) * self.rates[i] + ALPHA * hit
            else:
                self.rates.append(hit if not self.rates else (1 - ALPHA) * self.rates[-1] + ALPHA * hit)

    def expected_tokens(self, k: int) -> float:
        total, p = 1.0, 1.0
        for i in range(k):
            p *= self.rates[i] if i < len(self.rates) else (self.rates[-1] if self.rates else PRIOR_ACCEPTANCE)
            total += p
        return total


class AdaptiveK:
    """Chooses k per request per step; fed with every step's timings."""

    def __init__(self) -> None:
        self.fit = _Fit()
        self.last_choices: list[int] = []

    def observe_step(self, rows: int, verify_s: float, draft_s: float, drafted: bool) -> None:
        self.fit.observe(rows, verify_s, draft_s, drafted)

    def choose(self, trace: AcceptanceTrace, k_max: int, batch_size: int) -> int:
        if k_max <= 0 or self.fit.n < WARMUP_STEPS:
            return k_max
        if trace.steps_at_zero >= PROBE_EVERY:
            trace.steps_at_zero = 0
            return 1
        t0, t_row = self.fit.costs()
        best_k, best = 0, 1.0 / (t0 / batch_size + t_row)
        for k in range(1, k_max + 1):
            rate = trace.expected_tokens(k) / (t0 / batch_size + t_row * (k + 1) + self.fit.draft_s / batch_size)
            if rate > best:
                best_k, best = k, rate
        trace.steps_at_zero = trace.steps_at_zero + 1 if best_k == 0 else 0
        return best_k
