"""Prefix-aware routing: a conversation stays on its replica, tenants never share blocks, an overloaded replica is
passed over, a replica gone is forgotten, and Generate routes by the caller's prompt and tenant."""

from __future__ import annotations

import asyncio

import pytest

from blockspec.common.config import RoutingConfig
from blockspec.common.wire.auth import ApiKeys
from blockspec.protos import api_pb2
from blockspec.services.router.messages import ModelFacts
from blockspec.services.router.prefix_routing import BlockMemory, PrefixRouter, prefix_router
from blockspec.services.router.scheduler import Stream
from blockspec.services.router.server import GenerationService, Version
from blockspec.services.router.step_loop import FinishEvent, RequestStats

SYSTEM = list(range(100, 164))  # 4 blocks of 16 tokens


class Replica:
    """A replica as routing sees it: its load and, for Generate, a submit that finishes at once."""

    def __init__(self, name: str, load: int = 0) -> None:
        self.replica, self.load, self.lost = name, load, False
        self.prompts: list[tuple[int, ...]] = []

    async def submit(self, request) -> Stream:
        self.prompts.append(request.prompt_ids)
        events: asyncio.Queue = asyncio.Queue()
        events.put_nowait(FinishEvent(request.request_id, "length", (), RequestStats()))
        return Stream(request.request_id, events)

    async def cancel(self, key: str) -> None:
        return None

    def __repr__(self) -> str:
        return f"Replica({self.replica})"


def turns(first: list[int], count: int) -> list[list[int]]:
    """A conversation's prompts: each the previous one, a reply and a new user message (48 tokens together)."""
    prompts = [first]
    for t in range(1, count):
        prompts.append(prompts[-1] + [200 + (48 * t + i) % 100 for i in range(48)])
    return prompts


def test_a_conversations_turns_stay_on_its_replica():
    router = PrefixRouter()
    replicas = [Replica("0"), Replica("1"), Replica("2")]
    chosen = []
    for prompt in turns(SYSTEM + [7] * 20, 5):
        replica = router.route(replicas, prompt, "team-a")
        chosen.append(replica)
        replica.load += 1  # the least loaded replica moves on: without the prefix each turn would go elsewhere
    assert chosen == [replicas[0]] * 5


def test_a_new_conversation_of_a_tenant_goes_where_its_system_prompt_went():
    router = PrefixRouter()
    replicas = [Replica("0"), Replica("1")]
    first = router.route(replicas, SYSTEM + [1] * 16, "team-a")
    first.load = 2
    assert router.route(replicas, SYSTEM + [2] * 16, "team-a") is first


def test_another_tenants_identical_prompt_matches_nothing():
    router = PrefixRouter()
    replicas = [Replica("0"), Replica("1")]
    first = router.route(replicas, SYSTEM, "team-a")
    first.load = 1
    other = router.route(replicas, SYSTEM, "team-b")
    assert other is not first  # the salt: team-b's blocks are not team-a's, so the least loaded takes it
    assert router.memory[first].matched(router.hashes(SYSTEM, "team-b")) == 0
    assert router.memory[first].matched(router.hashes(SYSTEM, "team-a")) == 4


@pytest.mark.parametrize(("load", "least", "kept"), [
    (4, 0, True),  # 4 over: within the absolute bound
    (5, 0, False),  # 5 over and more than 1.5 times
    (15, 10, True),  # 5 over but only 1.5 times: within the relative bound
    (16, 10, False),
])
def test_a_replica_far_above_the_least_loaded_is_passed_over(load, least, kept):
    router = PrefixRouter(balance_abs_threshold=4, balance_rel_threshold=1.5)
    replicas = [Replica("0"), Replica("1")]
    warm = router.route(replicas, SYSTEM, "team-a")
    cold = replicas[1] if warm is replicas[0] else replicas[0]
    warm.load, cold.load = load, least
    assert (router.route(replicas, SYSTEM + [3] * 16, "team-a") is warm) == kept


@pytest.mark.parametrize(("new_blocks", "kept"), [(2, False), (1, True)])  # 1 of 3 blocks matched; 1 of 2
def test_a_match_below_the_cache_threshold_goes_to_the_least_loaded(new_blocks, kept):
    router = PrefixRouter(cache_threshold=0.5)
    replicas = [Replica("0"), Replica("1")]
    warm = router.route(replicas, SYSTEM[:16], "team-a")
    warm.load = 1
    assert (router.route(replicas, SYSTEM[:16] + [5] * 16 * new_blocks, "team-a") is warm) == kept


def test_a_prompt_shorter_than_a_block_goes_to_the_least_loaded():
    router = PrefixRouter()
    replicas = [Replica("0", load=3), Replica("1", load=1)]
    assert router.route(replicas, [1, 2, 3], "team-a") is replicas[1]
    assert not router.memory


def test_a_replica_gone_is_forgotten():
    router = PrefixRouter()
    a, b, c = Replica("0"), Replica("1"), Replica("2")
    assert router.route([a, b, c], SYSTEM, "team-a") is a
    router.route([b, c], [9] * 16, "team-a")  # `a` drained or lost: out of the replicas, its cache gone
    assert a not in router.memory
    a.load = 2  # back, busier but within the bounds: remembered, it would take the prompt for its cache
    assert router.route([a, b, c], SYSTEM + [4] * 16, "team-a") is b
    router.route([b], SYSTEM, "team-a")  # a lone replica: the others are forgotten too
    assert set(router.memory) == {b}


def test_the_memory_forgets_the_least_recently_sent_and_a_chain_from_its_tail():
    memory = BlockMemory(capacity=4)
    memory.record([1, 2, 3])
    memory.record([7, 8])  # 5 blocks held: the oldest, the deepest of the first prompt, goes
    assert memory.matched([1, 2, 3]) == 2 and memory.matched([7, 8]) == 2 and len(memory) == 4


def test_the_config_picks_the_policy():
    assert prefix_router(RoutingConfig(policy="least_loaded")) is None
    routing = prefix_router(RoutingConfig(cache_threshold=0.5, balance_abs_threshold=2))
    assert routing.cache_threshold == 0.5 and routing.balance_abs_threshold == 2


@pytest.mark.parametrize(("policy", "second"), [("least_loaded", "0"), ("prefix", "1")])
def test_least_loaded_config_routes_by_load_alone(policy, second):
    routing = prefix_router(RoutingConfig(policy=policy))
    a, b = Replica("0", load=1), Replica("1")
    version = Version(None, [a, b], routing=routing)
    assert version.replica(SYSTEM, "team-a") is b
    b.load = 2
    assert version.replica(SYSTEM, "team-a").replica == second


def test_the_version_routes_among_open_replicas_only():
    a, b = Replica("0"), Replica("1")
    version = Version(None, [a, b])
    assert version.replica(SYSTEM, "team-a") is a
    version.draining.add(a)
    assert version.replica(SYSTEM, "team-a") is b  # draining: takes nothing new, and its memory goes
    assert a not in version.routing.memory


class Context:
    """The little of a grpc.aio context Generate uses, with the caller's key."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def send_initial_metadata(self, _metadata) -> None:
        pass

    def invocation_metadata(self) -> tuple:
        return (("authorization", f"Bearer {self.key}"),)

    async def abort(self, code, message, trailing_metadata=()) -> None:
        raise AssertionError(f"{code}: {message}")


def test_generate_sends_a_second_turn_to_the_first_turns_replica(tokenizer):
    """Generate routes by the prompt's token ids and the caller's tenant: the second turn goes where the first went,
    though the other replica is less loaded by then; another tenant's identical prompt does not follow it."""
    a, b = Replica("0", load=1), Replica("1")
    facts = ModelFacts("t", "d", "none", 0, 0, 4096, 320, tokenizer)
    keys = ApiKeys({"a" * 24: "team-a", "b" * 24: "team-b"})
    service = GenerationService(Version(facts, [a, b]), api_keys=keys)
    first, second = turns(SYSTEM + [7] * 8, 2)

    def generate(prompt: list[int], key: str, rid: str) -> None:
        msg = api_pb2.GenerateRequest(request_id=rid, token_ids=api_pb2.TokenIds(ids=prompt), max_tokens=4)

        async def call():
            async for _ in service.Generate(msg, Context(key)):
                pass

        asyncio.run(call())

    generate(first, "a" * 24, "t1")
    assert b.prompts == [tuple(first)]
    a.load, b.load = 0, 2
    generate(second, "a" * 24, "t2")
    assert b.prompts == [tuple(first), tuple(second)]
    generate(second, "b" * 24, "t3")  # team-b: no match, the least loaded
    assert a.prompts == [tuple(second)]


def test_a_version_routes_by_its_replicas_own_blocks(tiny_models):
    """start_version sizes the router's memory and its hashes by the replicas' KV cache: its blocks and block size."""
    from blockspec.services.engine.engine import Engine
    from blockspec.services.router.app import start_version

    engine = Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=2, max_len=128, kv_cache_tokens=256,
                    kv_block_size=32)

    async def run():
        version = await start_version([engine.loop], engine.facts(), None, RoutingConfig())
        try:
            return version.routing
        finally:
            for scheduler in version.schedulers:
                await scheduler.stop()

    routing = asyncio.run(run())
    assert (routing.capacity_blocks, routing.block_size) == (8, 32) == (engine.verifier.num_blocks, 32)
