"""Admission (services/router/admission.py): a request's id and reserved tokens, given back once whichever way its
stream ends."""

from __future__ import annotations

import pytest

from blockspec.common.config import RateLimits
from blockspec.services.router.admission import Admissions, AlreadyRunning
from blockspec.services.router.limits import OverLimit, TenantLimits
from blockspec.services.router.step_loop import Request


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(rid: str = "r", prompt: int = 10, max_tokens: int = 40) -> Request:
    return Request(rid, tuple(range(prompt)), max_tokens, k=0)


def room(limits: TenantLimits, tenant: str = "a") -> int:
    """Tokens the tenant can take now: the largest admit that passes (an admit is undone by its refund)."""
    for tokens in range(100, 0, -1):
        try:
            limits.admit(tenant, tokens)
        except OverLimit:
            continue
        limits.refund(tenant, tokens)
        return tokens
    return 0


@pytest.fixture
def admissions() -> Admissions:
    return Admissions(TenantLimits(RateLimits(tokens_per_minute=100), Clock()))


def test_what_a_stream_did_not_spend_comes_back_on_exit(admissions):
    with admissions.admit(request(), "a", max_tokens_set=True) as admission:
        assert room(admissions.limits) == 50  # prompt 10 + max_tokens 40 reserved
        admission.sent = 15
    assert room(admissions.limits) == 75  # 25 of the 40 unsent came back; the prompt and 15 sent are spent
    admissions.admit(request(), "a", max_tokens_set=True).release()  # the id is free again


def test_a_request_no_replica_took_gets_its_prompt_back_too(admissions):
    with admissions.admit(request(), "a", max_tokens_set=True) as admission:
        admission.prompt_spent = False
    assert room(admissions.limits) == 100


def test_an_exception_inside_releases_and_a_second_release_gives_nothing_more(admissions):
    with pytest.raises(RuntimeError), admissions.admit(request(), "a", max_tokens_set=True) as admission:
        raise RuntimeError("the stream failed")
    assert admission.released and room(admissions.limits) == 90
    admission.release()
    assert room(admissions.limits) == 90


def test_a_running_id_is_refused_before_any_budget_is_taken(admissions):
    held = admissions.admit(request(), "a", max_tokens_set=True)
    with pytest.raises(AlreadyRunning, match="request_id: 'r' is already running"):
        admissions.admit(request(), "a", max_tokens_set=True)
    assert room(admissions.limits) == 50
    held.release()


def test_an_early_release_frees_the_id_for_a_resend_that_the_late_exit_keeps(admissions):
    first = admissions.admit(request(), "a", max_tokens_set=True)
    first.release()  # the stream ended: a client may resend under the id now
    second = admissions.admit(request(max_tokens=20), "a", max_tokens_set=True)
    with first:  # the first call's `with` exits after the resend was admitted: the resend keeps its id
        pass
    with pytest.raises(AlreadyRunning):
        admissions.admit(request(), "a", max_tokens_set=True)
    second.release()


def test_an_unset_max_tokens_is_cut_to_what_the_buckets_hold(admissions):
    admission = admissions.admit(request(max_tokens=500), "a", max_tokens_set=False)
    assert admission.request.max_tokens == 90 and room(admissions.limits) == 0
    admission.release()
    assert room(admissions.limits) == 90


def test_without_limits_only_the_id_is_held():
    admissions = Admissions(None)
    with admissions.admit(request(), "a", max_tokens_set=True):
        with pytest.raises(AlreadyRunning):
            admissions.admit(request(), "b", max_tokens_set=True)
    admissions.admit(request(), "b", max_tokens_set=True).release()


class Aborted(Exception):
    pass


class Context:
    """The little of a grpc.aio context Generate uses before its request reaches a replica."""

    async def send_initial_metadata(self, _metadata) -> None:
        pass

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code, message, trailing_metadata=()) -> None:
        raise Aborted(code, message)


def test_a_version_without_replicas_gives_back_all_it_reserved(tokenizer):
    """A request that reaches a version being stopped (no replica left) ends UNAVAILABLE, and its tenant gets the
    prompt's and max_tokens' reservation back: nothing ran."""
    import asyncio

    import grpc

    from blockspec.common.wire.auth import DEFAULT_TENANT
    from blockspec.protos import api_pb2
    from blockspec.services.router.messages import ModelFacts
    from blockspec.services.router.server import GenerationService, Version

    facts = ModelFacts("t", "d", "none", 0, 0, 256, 320, tokenizer)
    limits = TenantLimits(RateLimits(tokens_per_minute=100), Clock())
    service = GenerationService(Version(facts, []), limits=limits)
    msg = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=list(range(10))), max_tokens=40)

    async def call():
        async for _ in service.Generate(msg, Context()):
            pass

    with pytest.raises(Aborted) as err:
        asyncio.run(call())
    assert err.value.args[0] == grpc.StatusCode.UNAVAILABLE
    assert room(limits, DEFAULT_TENANT) == 100
