"""Adaptive k: the expected-tokens model and the choice against measured step costs."""

from __future__ import annotations

import pytest

from blockspec.services.router.adaptive_k import WARMUP_STEPS, AcceptanceTrace, AdaptiveK


def trace_with(rates: list[float]) -> AcceptanceTrace:
    return AcceptanceTrace(rates=list(rates))


def fitted(t0: float, t_row: float, draft_s: float) -> AdaptiveK:
    ak = AdaptiveK()
    for i in range(WARMUP_STEPS * 4):
        rows = 1 + i % 9
        ak.observe_step(rows, t0 + t_row * rows, draft_s, drafted=True)
    return ak


def test_expected_tokens_multiplies_conditional_acceptance():
    t = trace_with([0.5, 0.5])
    assert t.expected_tokens(0) == 1.0
    assert t.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)
    assert t.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)  # beyond the trace: the last rate


def test_observation_updates_only_judged_positions():
    t = AcceptanceTrace()
    t.observe(drafted=5, accepted=2)  # positions 0, 1 accepted, 2 rejected, 3-4 never judged
    # A position seen for the first time starts from the previous position's rate, then moves by ALPHA.
    assert t.rates == pytest.approx([1.0, 1.0, 0.8])
    t.observe(drafted=1, accepted=0)
    assert t.rates == pytest.approx([0.8, 1.0, 0.8])


def test_fit_recovers_the_linear_step_cost():
    ak = fitted(0.004, 0.0005, 0.002)
    t0, t_row = ak.fit.costs()
    assert t0 == pytest.approx(0.004, rel=0.05) and t_row == pytest.approx(0.0005, rel=0.05)


def test_choice_drafts_when_it_pays_and_not_when_it_does_not():
    ak = fitted(0.004, 0.0002, 0.001)  # a step costs mostly its fixed part: drafting is cheap
    assert ak.choose(trace_with([0.9] * 7), 7, batch_size=1) == 7
    assert ak.choose(trace_with([0.0] * 7), 7, batch_size=1) == 0
    # At a large batch the fixed part is shared: every extra row costs more relative to what it buys.
    heavy = fitted(0.004, 0.002, 0.001)
    assert heavy.choose(trace_with([0.6] * 7), 7, batch_size=16) < heavy.choose(trace_with([0.6] * 7), 7, batch_size=1)


def test_requested_k_until_warm_and_a_probe_after_many_zero_steps():
    ak = AdaptiveK()
    assert ak.choose(trace_with([0.0]), 5, 1) == 5  # no cost fit yet
    ak = fitted(0.004, 0.0002, 0.001)
    t = trace_with([0.0] * 5)
    picks = [ak.choose(t, 5, 1) for _ in range(40)]
    assert picks.count(0) > 30 and 1 in picks
