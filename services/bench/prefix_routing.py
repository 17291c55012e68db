"""Prefix routing against least-loaded alone, simulated: replicas with LRU prefix caches serve multi-turn
conversations of several tenants, routed by the real PrefixRouter over the real block hashes; time is a cost model.

    python -m blockspec.services.bench.prefix_routing [--replicas 4] [--cache-blocks 4096] [--seed 0]
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS, block_hashes
from blockspec.services.router.prefix_routing import PrefixRouter

VOCAB = 32000


@dataclass(frozen=True)
class Workload:
    tenants: int = 8  # each with its own system prompt; tenant i opens conversations in proportion to 1 / (i + 1)
    system_tokens: int = 1000
    conversations: int = 400
    turns: int = 6  # each turn's prompt: the previous prompt, its reply and a new user message
    concurrency: int = 48  # conversations in flight at once (a finished one is followed by a new one)
    user_tokens: tuple[int, int] = (20, 120)
    reply_tokens: tuple[int, int] = (50, 300)
    think_s: tuple[int, int] = (0, 3)  # between a reply and the conversation's next turn


@dataclass(frozen=True)
class Costs:
    slots: int = 16  # requests a replica runs at once (server.max_batch); more wait for a slot
    prefill_ms: float = 0.1  # per prompt token not served from the cache
    decode_ms: float = 15.0  # per generated token


@dataclass(frozen=True)
class Turn:
    user: list[int]
    reply: list[int]
    think_s: float


@dataclass(frozen=True)
class Conversation:
    tenant: str
    system: list[int]
    turns: list[Turn]


def conversations(w: Workload, seed: int) -> list[Conversation]:
    """The workload, drawn once so that every policy serves the same requests."""
    rng = random.Random(seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(rng.randint(*bounds))]

    systems = [tokens((w.system_tokens, w.system_tokens)) for _ in range(w.tenants)]
    weights = [1 / (i + 1) for i in range(w.tenants)]
    out = []
    for _ in range(w.conversations):
        t = rng.choices(range(w.tenants), weights)[0]
        turns = [Turn(tokens(w.user_tokens), tokens(w.reply_tokens), rng.uniform(*w.think_s)) for _ in range(w.turns)]
        out.append(Conversation(f"tenant-{t}", systems[t], turns))
    return out


class BlockCache:
    """A replica's prefix cache: full blocks by hash, least recently used evicted; a prompt is served its leading
    cached blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.blocks = capacity, OrderedDict()

    def serve(self, hashes: list[int]) -> int:
        """Blocks of the prompt served from the cache; the prompt's blocks are cached from now on."""
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.blocks:
            hit += 1
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit


@dataclass(frozen=True)
class Request:
    conversation: int
    turn: int
    prompt: list[int]
    hashes: list[int]
    arrived: float


@dataclass(eq=False)
class Replica:
    cache: BlockCache
    load: int = 0  # requests held, running or waiting for a slot (as Scheduler.load)
    running: int = 0
    waiting: deque = field(default_factory=deque)


@dataclass
class Tally:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    imbalance: list[float] = field(default_factory=list)  # max / mean load over the replicas, at each arrival
    peak_load: int = 0
    wait_s: float = 0.0  # waiting for a slot, summed over the requests
    in_system_s: float = 0.0
    requests: int = 0


def simulate(policy: str, convs: list[Conversation], w: Workload, costs: Costs, replicas: int,
             cache_blocks: int) -> Tally:
    """Serve the conversations under `policy` ("prefix" or "least_loaded"), in simulated time."""
    fleet = [Replica(BlockCache(cache_blocks)) for _ in range(replicas)]
    router = PrefixRouter(capacity_blocks=cache_blocks)
    tally, events, seq = Tally(), [], 0
    prompts: dict[int, list[int]] = {}  # conversation -> its last prompt and reply

    def at(time: float, *event) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time, seq, *event))

    def start(replica: Replica, r: Request, now: float) -> None:
        hit = replica.cache.serve(r.hashes) * BLOCK_TOKENS
        tally.hit_tokens += hit
        tally.wait_s += now - r.arrived
        replica.running += 1
        reply = convs[r.conversation].turns[r.turn].reply
        at(now + (costs.prefill_ms * (len(r.prompt) - hit) + costs.decode_ms * len(reply)) / 1000, "finish", replica, r)

    def arrive(c: int, turn: int, now: float) -> None:
        conv, loads = convs[c], [r.load for r in fleet]
        if sum(loads):
            tally.imbalance.append(max(loads) * len(loads) / sum(loads))
        prompt = (prompts.get(c) or conv.system) + conv.turns[turn].user
        hashes = block_hashes(prompt, BLOCK_TOKENS, conv.tenant)
        replica = router.choose(fleet, hashes) if policy == "prefix" else min(fleet, key=lambda r: r.load)
        replica.load += 1
        tally.peak_load = max(tally.peak_load, replica.load)
        tally.prompt_tokens += len(prompt)
        request = Request(c, turn, prompt, hashes, now)
        if replica.running < costs.slots:
            start(replica, request, now)
        else:
            replica.waiting.append(request)

    def finish(replica: Replica, r: Request, now: float) -> None:
        replica.running -= 1
        replica.load -= 1
        tally.requests += 1
        tally.in_system_s += now - r.arrived
        if replica.waiting:
            start(replica, replica.waiting.popleft(), now)
        this = convs[r.conversation].turns[r.turn]
        prompts[r.conversation] = r.prompt + this.reply
        if r.turn + 1 < len(convs[r.conversation].turns):
            at(now + this.think_s, "arrive", r.conversation, r.turn + 1)
        elif opened[0] < len(convs):
            at(now + this.think_s, "arrive", opened[0], 0)
            opened[0] += 1

    opened = [min(w.concurrency, len(convs))]
    for c in range(opened[0]):
        at(c * w.think_s[1] / max(1, opened[0]), "arrive", c, 0)  # the first turns spread over one think time
    while events:
        now, _, kind, *args = heapq.heappop(events)
        if kind == "arrive":
            arrive(*args, now)
        else:
            finish(*args, now)
    return tally


def table(results: dict[str, Tally]) -> str:
    rows = ["| policy | prefix-cache hit rate | prefill tokens saved | load max/mean (mean, over arrivals) | "
            "peak load | mean wait for a slot (s) | mean time in system (s) |",
            "|---|---|---|---|---|---|---|"]
    for policy, t in results.items():
        rows.append(f"| {policy} | {t.hit_tokens / t.prompt_tokens:.1%} | {t.hit_tokens:,} of {t.prompt_tokens:,} | "
                    f"{sum(t.imbalance) / len(t.imbalance):.2f} | {t.peak_load} | {t.wait_s / t.requests:.3f} | "
                    f"{t.in_system_s / t.requests:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--cache-blocks", type=int, default=4096,
                   help="each replica's prefix cache in blocks of 16 tokens (default: 16 slots of 4096 tokens)")
    p.add_argument("--tenants", type=int, default=Workload.tenants)
    p.add_argument("--conversations", type=int, default=Workload.conversations)
    p.add_argument("--concurrency", type=int, default=Workload.concurrency)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    w = Workload(tenants=args.tenants, conversations=args.conversations, concurrency=args.concurrency)
    convs = conversations(w, args.seed)
    results = {policy: simulate(policy, convs, w, Costs(), args.replicas, args.cache_blocks)
               for policy in ("prefix", "least_loaded")}
    print(f"{args.replicas} replicas of {Costs.slots} slots, {args.cache_blocks} cached blocks each; {w.tenants} tenants "
          f"({w.system_tokens}-token system prompts), {w.conversations} conversations of {w.turns} turns, "
          f"{w.concurrency} at once; seed {args.seed}\n")
    print(table(results))
    bound = simulate("least_loaded", convs, w, Costs(slots=len(convs)), 1, 1 << 40)
    print(f"\nbound: one replica with an unbounded cache hits {bound.hit_tokens / bound.prompt_tokens:.1%}")


if __name__ == "__main__":
    main()
