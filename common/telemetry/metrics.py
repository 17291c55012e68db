"""Metric instruments (Prometheus) in one place; spec-decode names follow vLLM's.

Acceptance rate = num_accepted_tokens / num_draft_tokens; tau = 1 + num_accepted_tokens / num_drafts.
Latency: time to first token; inter-token latency is *per token* (a message's gap spread over the
tokens it carries); the inter-chunk gap is the time between two messages of a stream.
"""

from __future__ import annotations

import sys
import time

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


ROLE_MEMORY_MAX_AGE_S = 0.5  # a role op reports its process's memory at most this old (a gauge, not an accounting)
_last_memory: list = [float("-inf"), (0, 0)]  # (monotonic time read, (rss, gpu))


def process_memory(max_age_s: float = 0.0) -> tuple[int, int]:
    """(resident bytes of this process, CUDA bytes allocated by it; 0 without a GPU). max_age_s > 0: the last
    reading where it is that recent (a reading is too dear for every role op to pay)."""
    now = time.monotonic()
    if now - _last_memory[0] > max_age_s:
        torch = sys.modules.get("torch")  # a process that never loaded torch holds no CUDA memory
        gpu = torch.cuda.memory_allocated() if torch is not None and torch.cuda.is_available() else 0
        _last_memory[:] = [now, (psutil.Process().memory_info().rss, gpu)]
    return _last_memory[1]


DEFAULT_VERSION = "default"  # the serving version of a router built without a config (model.version names it there)


class _Bound:
    """One instrument at one serving version: `.labels(...)` adds the version to the labels given, and an instrument
    with no other label is used as is (`.inc()`, `.set()`, `.observe()`)."""

    __slots__ = ("_metric", "_version")

    def __init__(self, metric, version: str) -> None:
        self._metric, self._version = metric, version

    def labels(self, **labels):
        return self._metric.labels(version=self._version, **labels)

    def __getattr__(self, name: str):
        return getattr(self._metric.labels(version=self._version), name)


class RouterMetrics:
    """The router's instruments, registered in `registry` (the process default for /metrics). Every one carries the
    serving version as its `version` label: this object writes `version`'s series, and `at(other)` another version's
    (blue/green rollouts, services/serving/rollout.py)."""

    def __init__(self, registry: CollectorRegistry | None = None, version: str = DEFAULT_VERSION) -> None:
        self._instruments = _Instruments(registry)
        self.version = version
        self._bound: dict[str, _Bound] = {}

    def at(self, version: str) -> RouterMetrics:
        """The same instruments, written at `version`."""
        view = RouterMetrics.__new__(RouterMetrics)
        view._instruments, view.version, view._bound = self._instruments, version, {}
        return view

    def drop(self) -> None:
        """Remove every series of this view's version from the instruments: a version that stopped serving (a retired
        or failed release) leaves no gauge reading on stale, and its series end."""
        for metric in vars(self._instruments).values():
            metric.remove_by_labels({"version": self.version})

    def __getattr__(self, name: str) -> _Bound:
        if name.startswith("_"):
            raise AttributeError(name)
        bound = self._bound.get(name)
        if bound is None:
            bound = self._bound[name] = _Bound(getattr(self._instruments, name), self.version)
        return bound


class _Instruments:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        def by(*names: str) -> dict:  # every instrument is labelled by version first
            return {"labelnames": ("version", *names), **({"registry": registry} if registry is not None else {})}

        kw, per_replica = by(), by("replica")
        # Speculative decoding.
        self.num_drafts = Counter("blockspec_spec_decode_num_drafts", "Request-steps that verified a draft", **kw)
        self.num_draft_tokens = Counter("blockspec_spec_decode_num_draft_tokens", "Draft tokens verified", **kw)
        self.num_accepted_tokens = Counter("blockspec_spec_decode_num_accepted_tokens", "Draft tokens accepted", **kw)
        self.accepted_per_pos = Counter("blockspec_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0 = first)",
                                        **by("position"))
        self.acceptance_rate = Gauge("blockspec_spec_decode_acceptance_rate",
                                     "Accepted / drafted tokens over the last steps", **per_replica)
        self.mean_k = Gauge("blockspec_spec_decode_k", "Draft tokens asked per request in the last step (adaptive k)",
                            **per_replica)
        self.tau = Gauge("blockspec_spec_decode_tau", "Tokens committed per request-step over the last steps", **per_replica)
        self.num_lookup_drafts = Counter("blockspec_spec_decode_num_lookup_drafts",
                                         "Request-steps drafted by prompt lookup instead of the drafter", **kw)
        self.drafter_fallbacks = Counter("blockspec_drafter_fallbacks",
                                         "Request-steps run at k=0 because the drafter failed or timed out", **kw)
        self.steps = Counter("blockspec_steps", "Batched propose -> verify rounds", **kw)
        # Throughput and load.
        self.generation_tokens = Counter("blockspec_generation_tokens", "Tokens generated (rate = tokens/s)", **kw)
        self.prompt_tokens = Counter("blockspec_prompt_tokens", "Prompt tokens admitted", **kw)
        self.tokens_per_s = Gauge("blockspec_generation_tokens_per_second", "Tokens/s over the last log interval",
                                  **per_replica)
        self.requests_running = Gauge("blockspec_requests_running", "Requests in the running batch", **per_replica)
        self.requests_waiting = Gauge("blockspec_requests_waiting", "Requests queued for a slot", **per_replica)
        self.kv_slots_used = Gauge("blockspec_kv_slots_used", "Verifier KV cache slots in use", **per_replica)
        self.kv_cache_usage = Gauge("blockspec_kv_cache_usage_perc", "Share of the verifier's KV cache blocks held by "
                                    "requests (1 = full; cached, unheld blocks count as free)", **per_replica)
        self.prefix_cache_queries = Counter("blockspec_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache", **per_replica)
        self.prefix_cache_hits = Counter("blockspec_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                         "(hit rate = hits / queries)", **per_replica)
        self.num_preemptions = Counter("blockspec_num_preemptions", "Requests whose KV blocks were taken back for "
                                       "others (each resumes where it stood)", **per_replica)
        self.role_memory = Gauge("blockspec_role_memory_bytes", "Memory of each role process (kind: rss or gpu)",
                                 **by("replica", "role", "kind"))
        # Replicas (server.autoscaling).
        self.replicas = Gauge("blockspec_replicas", "Replicas by state: desired (the autoscaler's), ready, starting, "
                              "draining", **by("state"))
        self.autoscale_waiting = Gauge("blockspec_autoscale_waiting_requests",
                                       "Requests waiting for a slot over every replica, as the autoscaler last read it",
                                       **kw)
        # Requests and latency as clients see it.
        self.requests_finished = Counter("blockspec_requests_finished", "Finished streams by finish reason",
                                         **by("reason"))
        self.rate_limited = Counter("blockspec_rate_limited", "Requests refused by their tenant's rate limit "
                                    "(server.rate_limit), by tenant and limit", **by("tenant", "limit"))
        self.request_errors = Counter("blockspec_request_errors", "Requests answered with an error, by gRPC status",
                                      **by("code"))
        self.time_to_first_token = Histogram("blockspec_time_to_first_token_seconds",
                                             "Arrival to the first token's message", buckets=LATENCY_BUCKETS, **kw)
        self.inter_token_latency = Histogram("blockspec_inter_token_latency_seconds",
                                             "Per token: a message's gap to the previous one / its tokens",
                                             buckets=LATENCY_BUCKETS, **kw)
        self.inter_chunk_gap = Histogram("blockspec_inter_chunk_gap_seconds", "Gap between two messages of a stream",
                                         buckets=LATENCY_BUCKETS, **kw)
        self.request_latency = Histogram("blockspec_e2e_request_latency_seconds", "Arrival to the last message",
                                         buckets=REQUEST_BUCKETS, **kw)
