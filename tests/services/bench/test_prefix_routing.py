"""The prefix routing simulation: deterministic per seed, and prefix routing serves more of the prompts from the
replicas' caches than least-loaded routing on the same requests."""

from __future__ import annotations

from blockspec.services.bench.prefix_routing import Costs, Workload, conversations, simulate


def test_prefix_routing_hits_the_cache_more_and_the_run_repeats():
    w = Workload(tenants=3, conversations=24, concurrency=8)
    convs = conversations(w, seed=1)
    prefix = simulate("prefix", convs, w, Costs(), replicas=3, cache_blocks=512)
    least = simulate("least_loaded", convs, w, Costs(), replicas=3, cache_blocks=512)
    assert prefix.prompt_tokens == least.prompt_tokens and prefix.requests == least.requests == 24 * w.turns
    assert prefix.hit_tokens > least.hit_tokens
    assert simulate("prefix", conversations(w, seed=1), w, Costs(), replicas=3, cache_blocks=512) == prefix
