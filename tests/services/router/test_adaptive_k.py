"""Adaptive k: the expected-tokens model, the step-cost table and the choice of width per step."""

from __future__ import annotations

import pytest

from blockspec.common.contracts import StepCosts
from blockspec.services.router.adaptive_k import (
    ALPHA,
    DRAFT_MARGIN,
    MIN_JUDGED,
    PRIOR_ACCEPTANCE,
    PROBE_EVERY,
    SPIKE,
    WARMUP_STEPS,
    AcceptanceTrace,
    AdaptiveK,
)


def trace_with(rates: list[float]) -> AcceptanceTrace:
    return AcceptanceTrace(rates=list(rates))


def table(fixed: float, per_row: float, sizes=(1, 2, 4, 8, 16), max_width: int = 8) -> StepCosts:
    """A verify cost table: fixed + per_row * batch * width seconds."""
    return StepCosts(tuple(sizes), tuple(range(1, max_width + 1)),
                     tuple(tuple(fixed + per_row * b * w for w in range(1, max_width + 1)) for b in sizes))


def warmed(costs: StepCosts, draft_s: float, overhead_s: float = 0.0, batch: int = 1) -> AdaptiveK:
    """After the warm-up steps, each run at the table's own speed with the drafter at `draft_s`."""
    ak = AdaptiveK(costs)
    for _ in range(WARMUP_STEPS):
        ak.observe_step(batch, 8, costs.verify_s(batch, 8), draft_s, overhead_s)
    return ak


def test_expected_tokens_multiplies_conditional_acceptance():
    t = trace_with([0.5, 0.5])
    assert t.expected_tokens(0) == 1.0
    assert t.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)
    assert t.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)  # beyond the trace: the last rate


def test_observation_updates_only_judged_positions():
    t = trace_with([0.5, 0.5, 0.5, 0.5])
    t.observe(drafted=5, accepted=2)  # positions 0, 1 accepted, 2 rejected, 3-4 never judged
    assert t.rates == pytest.approx([0.6, 0.6, 0.4, 0.5])
    fresh = AcceptanceTrace()
    fresh.observe(drafted=1, accepted=1)  # a new position starts from the prior guess
    assert fresh.rates == pytest.approx([PRIOR_ACCEPTANCE + ALPHA * (1 - PRIOR_ACCEPTANCE)])


def test_the_shared_rates_start_as_a_plain_mean():
    prior = AcceptanceTrace(alpha=0.02, mean_first=True)
    for accepted in (3, 3, 3, 0):  # position 0: accepted 3 times of 4
        prior.observe(drafted=3, accepted=accepted)
    assert prior.rates[0] == pytest.approx((PRIOR_ACCEPTANCE + 3) / 5)  # the mean, the guess as one term; not 2% steps


def test_a_request_not_drafting_relaxes_towards_all_requests():
    prior = trace_with([0.8, 0.8])
    t = trace_with([0.0, 0.0])
    for _ in range(20):
        t.observe(drafted=0, accepted=0, prior=prior)
    assert t.rates == pytest.approx([0.8, 0.8], abs=0.01)
    assert trace_with([0.5]).expected_tokens(2, prior) == pytest.approx(1 + 0.5 + 0.5 * 0.8)  # unseen: the prior's


def test_a_barely_judged_position_counts_at_least_the_one_before_it():
    prior = AcceptanceTrace(alpha=0.02, mean_first=True)
    for _ in range(30):
        prior.observe(drafted=7, accepted=3)  # positions 0-2 accepted 30 times, position 3 rejected 30 times
    for accepted in (4, 3, 3, 3):
        prior.observe(drafted=7, accepted=accepted)  # position 4 judged once: rejected; 5-6 never judged
    assert prior.rates[3] < 0.1 and prior.counts[3] >= MIN_JUDGED  # judged often: its own low rate stands
    assert prior.rate(3) == prior.rates[3]
    assert prior.rates[4] < 0.5 and prior.counts[4] == 1
    assert prior.rate(4) == prior.rate(3) and prior.rate(6) == prior.rate(3)  # barely or never judged: floored
    for _ in range(MIN_JUDGED):
        prior.observe(drafted=7, accepted=4)  # position 4 now judged MIN_JUDGED + 1 times, rejected every time
    assert prior.rate(4) == prior.rates[4] < prior.rate(3) + 0.05


def test_an_unlucky_start_at_deep_positions_does_not_keep_the_chooser_narrow():
    # The warm-up of a run at concurrency 1 that then held k = 4: positions 0-4 judged 49 / 30 / 23 / 15 / 5 times,
    # position 3 accepted 5 times of 15 and position 4 once of 5; positions 5-6 barely or never judged.
    ak = warmed(table(0.004, 0.00002), draft_s=0.0002)  # a row and the drafter cost little next to a step
    for accepted in [0] * 19 + [1] * 7 + [2] * 8 + [3] * 10 + [4] * 4 + [5]:
        ak.observe_request(AcceptanceTrace(), 7, accepted)
    assert ak.prior.counts[:5] == [49, 30, 23, 15, 5]
    assert ak.choose([(AcceptanceTrace(), 7)]) == [7]  # taken at position 2's rate, they are drafted and so judged


def test_step_costs_interpolate_between_measured_batch_sizes():
    costs = table(0.004, 0.0005)
    assert costs.verify_s(4, 3) == pytest.approx(0.004 + 0.0005 * 12)
    assert costs.verify_s(3, 2) == pytest.approx(0.004 + 0.0005 * 6)  # between 2 and 4
    assert costs.verify_s(32, 1) == pytest.approx(0.004 + 0.0005 * 32)  # past 16, along the last segment
    assert costs.verify_s(1, 12) == costs.verify_s(1, 8)  # wider than measured: the widest


def test_choice_drafts_when_it_pays_and_not_when_it_does_not():
    ak = warmed(table(0.004, 0.0001), draft_s=0.001)  # a step costs mostly its fixed part: drafting is cheap
    assert ak.choose([(trace_with([0.9] * 7), 7)]) == [7]
    assert ak.choose([(trace_with([0.0] * 7), 7)]) == [0]


def test_a_large_batch_drafts_less_when_rows_cost():
    costs = table(0.004, 0.001)
    one = warmed(costs, 0.001).choose([(trace_with([0.6] * 7), 7)])
    many = warmed(costs, 0.001, batch=16).choose([(trace_with([0.6] * 7), 7)] * 16)
    assert many[0] < one[0]


def test_one_width_per_step_capped_by_each_request():
    ak = warmed(table(0.004, 0.0001), draft_s=0.001, batch=2)
    assert ak.choose([(trace_with([0.9] * 7), 7), (trace_with([0.9] * 7), 2)]) == [7, 2]


def test_a_slower_machine_is_seen_through_the_verify_times():
    costs = table(0.004, 0.0001)
    ak = warmed(costs, draft_s=0.001)
    for _ in range(30):
        ak.observe_step(1, 4, 3 * costs.verify_s(1, 4), 0.001, 0.0)
    assert ak.step_seconds(1, 1) == pytest.approx(3 * costs.verify_s(1, 1), rel=0.01)


def test_overhead_makes_speculation_pay_more():
    costs = table(0.004, 0.0015)
    trace = [(trace_with([0.5] * 7), 7)]
    assert warmed(costs, 0.003, overhead_s=0.0).choose(trace) == [0]
    assert warmed(costs, 0.003, overhead_s=0.02).choose(trace)[0] > 0


def test_requested_k_until_warm_and_a_probe_after_many_zero_steps():
    ak = AdaptiveK(table(0.004, 0.0001))
    assert ak.choose([(trace_with([0.0]), 5)]) == [5]  # warming up: the requested k
    ak = warmed(table(0.004, 0.0001), draft_s=0.0005)
    t = trace_with([0.05] * 5)  # drafting nearly pays: worth a probe now and then
    picks = [ak.choose([(t, 5)])[0] for _ in range(3 * PROBE_EVERY)]
    assert picks.count(0) > 2 * PROBE_EVERY and 1 in picks


def test_no_probe_where_drafting_is_far_from_paying():
    ak = warmed(table(0.004, 0.0001), draft_s=0.02)  # the drafter costs five plain steps
    t = trace_with([0.5] * 5)
    assert [ak.choose([(t, 5)])[0] for _ in range(3 * PROBE_EVERY)] == [0] * (3 * PROBE_EVERY)


def test_drafting_continues_on_a_smaller_gain_than_it_starts_on():
    """Hysteresis: drafting estimated 1.08x plain decoding keeps a drafting batch drafting, but does not
    start a batch at plain decoding (each return costs the drafter a context catch-up)."""
    costs = table(0.004, 0.0)  # every width costs the same verify: the rate is tokens / (verify + draft)
    gain = 1.08
    assert gain < DRAFT_MARGIN
    draft_s = 0.004 * (1.5 / gain - 1)  # one draft at acceptance 0.5: 1.5 tokens a step
    ak = warmed(costs, draft_s)
    ak.observe_step(1, 2, costs.verify_s(1, 2), draft_s, 0.0)
    t = [(trace_with([0.5]), 1)]
    ak.last_width = 2  # the batch is drafting
    assert ak.choose(t) == [1]
    ak.last_width = 1  # the batch is at plain decoding
    assert ak.choose(t) == [0]


def test_the_drafters_catch_up_is_not_its_usual_time():
    """A step where a request drafts for the first time since its prefill or a plain step includes the
    context the drafter skipped (the loop says so): it leaves the drafter's time as it was."""
    costs = table(0.004, 0.0001)
    ak = warmed(costs, draft_s=0.001)
    before = ak.draft_s[1, 8]
    ak.observe_step(1, 8, costs.verify_s(1, 8), 0.05, 0.0, caught_up=True)  # 50 ms of catch-up
    assert ak.draft_s[1, 8] == before
    ak.observe_step(1, 8, costs.verify_s(1, 8), 0.002, 0.0)  # the next one counts
    assert ak.draft_s[1, 8] == pytest.approx((1 - ALPHA) * before + ALPHA * 0.002)


def test_a_preempted_step_moves_a_cost_estimate_by_a_bounded_step():
    """One drafter call 20x its usual time (the VM preempted it) raises the estimate by ALPHA x SPIKE at most,
    not ALPHA x 20: a width that looked dear would not be chosen again to correct it."""
    costs = table(0.004, 0.0001)
    ak = warmed(costs, draft_s=0.001)
    ak.observe_step(1, 8, costs.verify_s(1, 8), 0.02, 0.0)
    assert ak.draft_s[1, 8] == pytest.approx(0.001 * (1 - ALPHA + ALPHA * SPIKE))


def test_a_looked_up_request_costs_no_drafter_time_and_is_judged_by_lookups_rates():
    """Prompt lookup drafts such a request: the step's estimate leaves out the drafter and takes the request's
    lookup trace, so a width the drafter's cost rules out can still pay."""
    ak = warmed(table(0.004, 0.0001), draft_s=0.02)  # the drafter costs five plain steps
    guess = trace_with([0.5] * 5)
    assert ak.choose([(guess, 5)]) == [0]
    assert ak.choose([(guess, 5)], [True])[0] > 0
    assert ak.choose([(guess, 5), (guess, 5)], [True, False]) == [0, 0]  # the drafter still drafts the other one


def test_lookup_steps_feed_their_own_rates_and_no_drafter_time():
    ak = warmed(table(0.004, 0.0001), draft_s=0.001)
    request = AcceptanceTrace()
    ak.observe_request(request, 5, 5, looked_up=True)
    assert ak.lookup_prior.counts[:5] == [1] * 5 and not ak.prior.counts
    drafter_time = dict(ak.draft_s)
    ak.observe_step(1, 6, 0.004, 0.00001, 0.0, drafted=0)  # every request looked up: no drafter call
    assert ak.draft_s == drafter_time
    ak.observe_step(2, 8, 0.004, 0.002, 0.0, drafted=1)  # one of two drafted: kept as the drafter's time for one
    assert ak.draft_s[1, 8] == pytest.approx((1 - ALPHA) * drafter_time[1, 8] + ALPHA * 0.002)
