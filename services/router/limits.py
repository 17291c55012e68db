"""Per-tenant rate limits at the router (server.rate_limit): token buckets of requests a minute, and of tokens a
minute and a day (a quota), per tenant. A request reserves prompt + max_tokens when it is admitted; what it did not generate is given back when
it ends (finished, stopped or cancelled), so a budget counts the tokens served, not the ones asked for."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from blockspec.common.config import RateLimits
from blockspec.common.errors import InvalidArgument


class OverLimit(Exception):
    """The tenant's bucket lacks room now; it will have it in `retry_after_s`."""

    def __init__(self, message: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.limit, self.retry_after_s = limit, retry_after_s


# Each limit: (its key in RateLimit, seconds a full bucket lasts, whether it counts tokens or requests).
LIMITS = (("requests_per_minute", 60.0, False), ("tokens_per_minute", 60.0, True), ("tokens_per_day", 86400.0, True))


@dataclass
class Bucket:
    """Holds up to `capacity`, refilled evenly over `period_s`; starts full."""

    capacity: int
    period_s: float
    level: float
    stamp: float

    def _refill(self, now: float) -> None:
        self.level = min(float(self.capacity), self.level + (now - self.stamp) * self.capacity / self.period_s)
        self.stamp = now

    def wait_s(self, amount: int, now: float) -> float:
        """Seconds until `amount` fits (0: it fits now)."""
        self._refill(now)
        return max(0.0, (amount - self.level) * self.period_s / self.capacity)

    def put(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(float(self.capacity), self.level + amount)

    def room(self, now: float) -> float:
        """What it holds now."""
        self._refill(now)
        return self.level


class TenantLimits:
    """server.rate_limit applied: `admit` takes from all of a tenant's buckets or from none."""

    def __init__(self, config: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._lock = threading.Lock()  # the router's event loop and the tests' threads

    @property
    def enabled(self) -> bool:
        return any(getattr(x, key) for x in (self.config, *self.config.tenants.values()) for key, _, _ in LIMITS)

    def _limits(self, tenant: str, tokens: int, now: float) -> list[tuple[str, int, Bucket, int, bool]]:
        """(limit, its value, the tenant's bucket, what a request of `tokens` takes from it, whether it counts
        tokens) for each limit set."""
        limit, out = self.config.tenants.get(tenant, self.config), []
        for key, period_s, counts_tokens in LIMITS:
            value = getattr(limit, key)
            if value:
                if (tenant, key) not in self._buckets:
                    self._buckets[tenant, key] = Bucket(value, period_s, float(value), now)
                out.append((key, value, self._buckets[tenant, key], tokens if counts_tokens else 1, counts_tokens))
        return out

    def admit(self, tenant: str, tokens: int) -> None:
        """Take one request and `tokens` from the tenant's buckets. InvalidArgument (max_tokens) where `tokens`
        exceeds a whole bucket, so waiting would not help; OverLimit where the buckets lack room now."""
        with self._lock:  # one time for every bucket: a bucket's stamp never goes back
            self._take(tenant, tokens, self.clock())

    def admit_up_to(self, tenant: str, prompt: int, most: int) -> int:
        """Admit a request of `prompt` tokens and up to `most` generated ones (a max_tokens left unset): as many as
        the tenant's token buckets hold now, at least one, read and taken under one lock; returns them. Refused as
        `admit` refuses where not even one fits."""
        with self._lock:
            now = self.clock()
            rooms = [b.room(now) for _, _, b, _, counts_tokens in self._limits(tenant, 0, now) if counts_tokens]
            granted = min(most, max(1, math.floor(min(rooms, default=prompt + most)) - prompt))
            self._take(tenant, prompt + granted, now)
            return granted

    def _take(self, tenant: str, tokens: int, now: float) -> None:
        limits = self._limits(tenant, tokens, now)
        for key, value, _, amount, _ in limits:
            if amount > value:
                raise InvalidArgument("max_tokens", f"the prompt's and max_tokens' {tokens} tokens exceed tenant "
                                                    f"{tenant!r}'s {key} of {value}: lower max_tokens")
        wait_s, key, value = max(((b.wait_s(amount, now), key, value) for key, value, b, amount, _ in limits),
                                 default=(0.0, "", 0))
        if wait_s > 0:
            raise OverLimit(f"rate limit: tenant {tenant!r} is over its {key} ({value}); retry in "
                            f"{math.ceil(wait_s * 10) / 10:g} s", key, wait_s)
        for _, _, bucket, amount, _ in limits:
            bucket.put(-amount, now)

    def refund(self, tenant: str, tokens: int) -> None:
        """Give back reserved tokens a request did not use."""
        if tokens <= 0:
            return
        with self._lock:
            now = self.clock()
            for _, _, bucket, amount, counts_tokens in self._limits(tenant, tokens, now):
                if counts_tokens:
                    bucket.put(amount, now)
