"""Metric instruments (Prometheus) in one place; names follow vLLM's spec-decode metrics.

Acceptance rate = num_accepted_tokens / num_draft_tokens; tau = 1 + num_accepted_tokens / num_drafts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    """The router's instruments, registered in `registry` (the process default for /metrics)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw = {"registry": registry} if registry is not None else {}
        self.num_drafts = Counter("blockspec_spec_decode_num_drafts", "Steps that verified a draft", **kw)
        self.num_draft_tokens = Counter("blockspec_spec_decode_num_draft_tokens", "Draft tokens verified", **kw)
        self.num_accepted_tokens = Counter("blockspec_spec_decode_num_accepted_tokens", "Draft tokens accepted", **kw)
        self.steps = Counter("blockspec_steps", "Batched propose -> verify rounds", **kw)
        per_replica = {"labelnames": ("replica",), **kw}
        self.requests_running = Gauge("blockspec_requests_running", "Requests in the running batch", **per_replica)
        self.requests_waiting = Gauge("blockspec_requests_waiting", "Requests queued for a slot", **per_replica)
        self.kv_slots_used = Gauge("blockspec_kv_slots_used", "Verifier KV cache slots in use", **per_replica)
        self.drafter_fallbacks = Counter("blockspec_drafter_fallbacks",
                                         "Request-steps run at k=0 because the drafter failed or timed out", **kw)
