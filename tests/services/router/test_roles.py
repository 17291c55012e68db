"""The role protocol's bookkeeping over gRPC: a timed-out drafter op still gets its release, a drafter maps a
restarted verifier, roles free a gone router's requests, prompts under way are prefilled first, replies match ops."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from blockspec.common.contracts import ProposeInput
from blockspec.common.sampling import GREEDY, SamplingParams, fill_pb, from_pb
from blockspec.protos import roles_pb2
from blockspec.services.drafter.service import DrafterService
from blockspec.services.router.roles import RemoteDrafter, RemoteVerifier
from blockspec.services.router.step_loop import Request, StepLoop
from blockspec.services.serving.launch import serve_drafter, serve_verifier, verifier_service
from tests.helpers import Loop, wait_for


@pytest.fixture
def roles(tiny_models, dflash_drafters):
    """A dflash verifier and drafter role (2 slots) behind gRPC on free ports: their services and addresses."""
    target, drafter = str(tiny_models["qwen3"]["target"]), str(dflash_drafters["qwen3-random"])
    loop = Loop()
    vsvc = verifier_service(target, "dflash", drafter, max_batch=2, max_len=256)
    dsvc = DrafterService("dflash", drafter, target, num_slots=2, max_len=256)
    vserver, _, vport = loop.run(serve_verifier(vsvc))
    dserver, _, dport = loop.run(serve_drafter(dsvc))
    yield {"verifier": vsvc, "drafter": dsvc, "verifier_address": f"127.0.0.1:{vport}",
           "drafter_address": f"127.0.0.1:{dport}"}
    loop.run(vserver.stop(0))
    loop.run(dserver.stop(0))
    vsvc.close()
    loop.close()


def test_a_drafter_op_that_timed_out_still_gets_its_release(roles, prompts):
    """Each request's only proposal times out (the drafter applies it all the same, taking a slot) and the request
    finishes at k=0 while the drafter is down. The reconnected router releases both: a later request drafts."""
    dsvc = roles["drafter"]
    run, slow = dsvc._run, []

    def run_late(*args):  # applied, but after the router's timeout
        if slow:
            slow.pop()
            time.sleep(2.0)
        return run(*args)

    dsvc._run = run_late
    dsvc._end_session = lambda session: None  # the release must come from the router's books, not from the stream's end
    verifier = RemoteVerifier(roles["verifier_address"])
    remote = RemoteDrafter(roles["drafter_address"], verifier, timeout_s=1.0, retry_s=2.4)  # a proposal here: ms
    steps = StepLoop(verifier, remote, max_batch=2, prefill_chunk=None)
    try:
        for i in range(2):
            slow.append(True)
            steps.submit(Request(f"r{i}", tuple(prompts[0][:20]), max_tokens=4, k=3))
            while not steps.idle:
                steps.step()
            time.sleep(2.6)  # past retry_s: the next proposal reconnects
        fallbacks = remote.fallbacks
        steps.submit(Request("fresh", tuple(prompts[0][:20]), max_tokens=12, k=3))
        while not steps.idle:
            steps.step()
        assert fallbacks > 0 and remote.fallbacks == fallbacks, "the later request fell back: slots leaked"
        assert "r0" not in dsvc._tokens and "r1" not in dsvc._tokens
    finally:
        remote.close()
        verifier.close()


def test_a_drafter_attached_to_a_restarted_verifier_maps_the_new_one(tiny_models, dflash_drafters):
    """A verifier restarts (new segments) while the drafter runs on: attached again, the drafter must read the new
    verifier's tap features and write its draft q where the new verifier reads it (the rejection rule's q)."""
    target, drafter = str(tiny_models["qwen3"]["target"]), str(dflash_drafters["qwen3-random"])
    old = verifier_service(target, "dflash", drafter, max_batch=2, max_len=256)
    dsvc = DrafterService("dflash", drafter, target, num_slots=2, max_len=256)
    asyncio.run(dsvc.Attach(old.info, None))
    dsvc._tokens["gone"] = [1, 2, 3]  # a request of the old verifier's
    new = verifier_service(target, "dflash", drafter, max_batch=2, max_len=256)
    try:
        old.close()
        asyncio.run(dsvc.Attach(new.info, None))
        dsvc._q_probs[0, 0, 0] = 0.5
        new.verifier.tap_buffer[0, 0, 0] = 7.0
        assert float(new.q_probs[0, 0, 0]) == 0.5 and float(dsvc._tap_buffer[0, 0, 0]) == 7.0
        assert "gone" not in dsvc._tokens
    finally:
        new.close()


def test_the_verifier_continues_a_prompt_under_way_before_new_ones(tiny_models, prompts):
    """Chunked prefill over gRPC: a long prompt part-way in the cache goes on first, as the in-process step loop
    orders it; new prompts first would let a stream of short ones starve it."""
    target = str(tiny_models["qwen3"]["target"])
    vsvc = verifier_service(target, "none", None, max_batch=2, max_len=512)
    try:
        long_ids = max(prompts, key=len)[:100]
        vsvc._run(roles_pb2.VerifierRequest(seq=1, prefill=[roles_pb2.PrefillItem(request_id="long", prompt_ids=long_ids)],
                                            prefill_budget=32))
        vsvc._run(roles_pb2.VerifierRequest(seq=2, prefill=[roles_pb2.PrefillItem(request_id="short", prompt_ids=prompts[1][:8])],
                                            prefill_continue=["long"], prefill_budget=32))
        v = vsvc.verifier
        assert len(long_ids) > 64 and v.runner.cache.lengths[v.slot_of("long")] == 64
    finally:
        vsvc.close()


def test_a_router_that_goes_away_leaves_no_request_in_the_roles(roles, prompts):
    """Roles run as their own services outlive a router that dies mid-run: when its streams end, both roles free
    what it held, and the router started next finds every slot free and drafts."""
    vsvc, dsvc = roles["verifier"], roles["drafter"]
    prompt = tuple(max(prompts, key=len)[:20])
    freed = []
    for _ in range(2):
        verifier = RemoteVerifier(roles["verifier_address"])
        remote = RemoteDrafter(roles["drafter_address"], verifier)
        steps = StepLoop(verifier, remote, max_batch=2, prefill_chunk=None)
        for i in range(2):
            steps.submit(Request(f"r{i}", prompt, max_tokens=64, k=3))
        for _ in range(3):
            steps.step()
        assert steps.num_running == 2 and remote.fallbacks == 0
        remote.close()  # gone without a release
        verifier.close()
        freed.append(wait_for(lambda: vsvc.verifier.free_slots == 2 and not dsvc._tokens
                           and dsvc.proposer.cache.free_slots == 2))
    assert freed == [True, True]


def test_a_drafter_takes_a_whole_context_resent_over_what_it_holds(tiny_models, dflash_drafters):
    """A router that reconnected resends whole contexts: where the drafter holds a prefix of one it goes on (before,
    it took it for a gap and drafted nothing that step); a context that does not extend what it holds is stale."""
    target, drafter = str(tiny_models["qwen3"]["target"]), str(dflash_drafters["qwen3-random"])
    dsvc = DrafterService("dflash", drafter, target, num_slots=2, max_len=256)
    dsvc._tokens.update({"same": [5, 6, 7], "other": [5, 6, 7]})
    dsvc._sampling.update({"same": GREEDY, "other": GREEDY})
    resent = roles_pb2.ProposeItem(request_id="same", committed_len=5, new_token_ids=[5, 6, 7, 8, 9], k=3)
    fill_pb(GREEDY, resent.sampling)  # a whole context comes with its sampling
    assert dsvc._accept(resent) and dsvc._tokens["same"] == [5, 6, 7, 8, 9]
    assert not dsvc._accept(roles_pb2.ProposeItem(request_id="other", committed_len=5, new_token_ids=[5, 6, 4, 8, 9], k=3))


def test_the_drafter_gets_a_requests_sampling_once(tiny_models, dflash_drafters):
    """The router sends a request's sampling with its first context only (and with the whole context again after a
    reconnect); the drafter keeps it, and a request it meets without one is stale (the router then resends all)."""
    sampled = SamplingParams(temperature=0.75, top_p=0.875, seed=7)  # exact in float32
    sent_items: list = []

    def op(items):
        sent_items.append(list(items))
        return roles_pb2.DrafterResponse(items=[roles_pb2.DraftItem(request_id=i.request_id) for i in items])

    client = RemoteDrafter.__new__(RemoteDrafter)  # its stream stubbed: what it sends is the question
    client._sent, client._stream, client.fallbacks = {}, object(), 0
    client.verifier = types.SimpleNamespace(slot_of=lambda rid: 0)
    client._op = op
    for context in ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8, 9]):
        client.propose([ProposeInput("r", context, 3, sampled)])
    assert [[i.HasField("sampling") for i in items] for items in sent_items] == [[True], [False], [False]]
    assert from_pb(sent_items[0][0].sampling) == sampled

    target, drafter = str(tiny_models["qwen3"]["target"]), str(dflash_drafters["qwen3-random"])
    dsvc = DrafterService("dflash", drafter, target, num_slots=2, max_len=256)
    for items in sent_items:
        for item in items:
            item.feature_slot = 0
            assert dsvc._accept(item)
    assert dsvc._sampling["r"] == sampled and dsvc._tokens["r"] == [5, 6, 7, 8, 9]
    unknown = roles_pb2.ProposeItem(request_id="new", committed_len=2, new_token_ids=[1, 2], k=3)
    assert not dsvc._accept(unknown) and "new" not in dsvc._tokens


def test_a_reply_out_of_step_with_its_op_fails_the_step(tiny_models, prompts):
    """The router reads each role's replies in order; one that answers another op (a bug on either side) fails the
    step instead of committing another op's tokens."""
    target = str(tiny_models["qwen3"]["target"])
    loop = Loop()
    vsvc = verifier_service(target, "none", None, max_batch=2, max_len=256)
    vserver, _, vport = loop.run(serve_verifier(vsvc))
    run = vsvc._run

    def run_off_by_one(req, *args):
        resp = run(req, *args)
        resp.seq += req.seq >= 3
        return resp

    vsvc._run = run_off_by_one
    verifier = RemoteVerifier(f"127.0.0.1:{vport}")
    steps = StepLoop(verifier, RemoteDrafterless(), max_batch=2, prefill_chunk=None)
    try:
        steps.submit(Request("r", tuple(max(prompts, key=len)[:20]), max_tokens=16, k=0))
        steps.step()  # ops 1 and 2: the prefill, a decode
        with pytest.raises(RuntimeError, match="answered op 4 to op 3"):
            steps.step()
    finally:
        verifier.close()
        loop.run(vserver.stop(0))
        vsvc.close()
        loop.close()


class RemoteDrafterless:
    """A drafter role for plain decoding: drafts nothing."""

    max_k = fallbacks = 0

    def propose(self, inputs):
        return []

    def release(self, request_id: str) -> None:
        pass
