"""Per-tenant rate limits at the router (server.rate_limit): a token bucket of requests and one of tokens per
tenant. A request reserves prompt + max_tokens when it is admitted; what it did not generate is given back when
it ends (finished, stopped or cancelled), so a budget counts the tokens served, not the ones asked for."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from blockspec.common.config import RateLimit, RateLimits
from blockspec.common.errors import InvalidArgument


class OverLimit(Exception):
    """The tenant's bucket lacks room now; it will have it in `retry_after_s`."""

    def __init__(self, message: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.limit, self.retry_after_s = limit, retry_after_s


@dataclass
class Bucket:
    """Holds up to `per_minute`, refilled at per_minute / 60 a second; starts full."""

    per_minute: int
    level: float
    stamp: float

    def _refill(self, now: float) -> None:
        self.level = min(float(self.per_minute), self.level + (now - self.stamp) * self.per_minute / 60.0)
        self.stamp = now

    def wait_s(self, amount: int, now: float) -> float:
        """Seconds until `amount` fits (0: it fits now)."""
        self._refill(now)
        return max(0.0, (amount - self.level) * 60.0 / self.per_minute)

    def put(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(float(self.per_minute), self.level + amount)


class TenantLimits:
    """server.rate_limit applied: `admit` takes from both of a tenant's buckets or from neither."""

    def __init__(self, config: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._lock = threading.Lock()  # the router's event loop and the tests' threads

    @property
    def enabled(self) -> bool:
        limits = [self.config, *self.config.tenants.values()]
        return any(x.requests_per_minute or x.tokens_per_minute for x in limits)

    def _limit(self, tenant: str) -> RateLimit:
        return self.config.tenants.get(tenant, self.config)

    def _bucket(self, tenant: str, kind: str, per_minute: int, now: float) -> Bucket:
        key = (tenant, kind)
        if key not in self._buckets:
            self._buckets[key] = Bucket(per_minute, float(per_minute), now)
        return self._buckets[key]

    def admit(self, tenant: str, tokens: int) -> None:
        """Take one request and `tokens` from the tenant's buckets. InvalidArgument (max_tokens) where `tokens`
        exceeds a whole minute's budget, so waiting would not help; OverLimit where the buckets lack room now."""
        limit = self._limit(tenant)
        if limit.tokens_per_minute and tokens > limit.tokens_per_minute:
            raise InvalidArgument("max_tokens", f"the prompt's and max_tokens' {tokens} tokens exceed tenant {tenant!r}'s "
                                                f"tokens_per_minute of {limit.tokens_per_minute}: lower max_tokens")
        wants = [(kind, per_minute, amount) for kind, per_minute, amount in
                 (("requests_per_minute", limit.requests_per_minute, 1), ("tokens_per_minute", limit.tokens_per_minute, tokens))
                 if per_minute]
        with self._lock:  # one time for every bucket: a bucket's stamp never goes back
            now = self.clock()
            buckets = [(kind, self._bucket(tenant, kind, per_minute, now), amount) for kind, per_minute, amount in wants]
            waits = [(bucket.wait_s(amount, now), kind) for kind, bucket, amount in buckets]
            wait_s, kind = max(waits, default=(0.0, ""))
            if wait_s > 0:
                raise OverLimit(f"rate limit: tenant {tenant!r} is over its {kind} ({getattr(limit, kind)}); retry in "
                                f"{math.ceil(wait_s * 10) / 10:g} s", kind, wait_s)
            for _, bucket, amount in buckets:
                bucket.put(-amount, now)

    def refund(self, tenant: str, tokens: int) -> None:
        """Give back reserved tokens a request did not use."""
        limit = self._limit(tenant)
        if tokens > 0 and limit.tokens_per_minute:
            with self._lock:
                now = self.clock()
                self._bucket(tenant, "tokens_per_minute", limit.tokens_per_minute, now).put(tokens, now)
