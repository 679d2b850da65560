"""Per-tenant quotas of one edge process: request rate, streams, tokens per minute, sockets.

Pure policy: every decision takes the caller's clock and returns a `Refusal` or None. The
counters live in this process only; a cluster-wide quota would need state shared between
edges (docs/security.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from shared.messages import Model

Limit = Literal["rps", "concurrency", "tokens_per_min", "sockets"]

# When a stream or socket ends cannot be known in advance: a hint, not a promise.
SLOT_RETRY_AFTER_MS = 1000


class TenantLimits(Model):
    """What one tenant may use of one edge; stored with the tenant in the keys file."""

    rps: float = Field(default=10.0, gt=0, description="Requests per second, sustained.")
    burst: int | None = Field(
        default=None, ge=1, description="Requests at once above the rate; unset: ceil(rps)."
    )
    concurrency: int = Field(default=32, ge=1, description="Streams in flight at once.")
    tokens_per_min: int = Field(
        default=200_000, ge=1, description="Prompt estimate + max_tokens, charged at admission."
    )
    sockets: int = Field(default=32, ge=1, description="WebSockets open at once.")

    @property
    def request_burst(self) -> int:
        return self.burst if self.burst is not None else max(1, math.ceil(self.rps))


@dataclass(frozen=True)
class Refusal:
    """A limit said no: what the client is told (`rate_limited`) and when to try again."""

    limit: Limit
    message: str
    retry_after_ms: int | None


class TokenBucket:
    """`capacity` units, refilled at `rate` per second; the caller's clock."""

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self._at = now

    def resize(self, rate: float, capacity: float) -> None:
        """New limits (the keys file changed): keep what was used, not more than fits."""
        self.rate = rate
        self.capacity = capacity
        self.level = min(self.level, capacity)

    def wait_s(self, cost: float, now: float) -> float | None:
        """Seconds until `cost` units are there (0: now); None if they never can be."""
        if cost > self.capacity:
            return None
        self._fill(now)
        return max(0.0, (cost - self.level) / self.rate)

    def take(self, cost: float, now: float) -> None:
        self._fill(now)
        self.level -= cost

    def _fill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = max(self._at, now)


@dataclass
class _TenantUse:
    requests: TokenBucket
    tokens: TokenBucket
    streams: set[str] = field(default_factory=set)
    sockets: int = 0


class Quotas:
    """Every tenant's use of this edge, checked against the limits the caller passes in.

    Caller: the edge's sockets, all on one event loop (no locks).
    Affects: only its own counters; `admit` counts a stream until `release(request_id)`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _TenantUse] = {}
        self._stream_tenant: dict[str, str] = {}

    def open_socket(self, tenant: str, limits: TenantLimits) -> Refusal | None:
        use = self._use(tenant, limits)
        if use.sockets >= limits.sockets:
            return Refusal(
                "sockets",
                f"{use.sockets} sockets open, the tenant's limit is {limits.sockets}",
                SLOT_RETRY_AFTER_MS,
            )
        use.sockets += 1
        return None

    def close_socket(self, tenant: str) -> None:
        use = self._tenants.get(tenant)
        if use is not None and use.sockets > 0:
            use.sockets -= 1

    def admit(
        self, tenant: str, limits: TenantLimits, request_id: str, tokens: int
    ) -> Refusal | None:
        """Charge one request of `tokens` (prompt estimate + max_tokens), or refuse it whole."""
        now = self._clock()
        use = self._use(tenant, limits)
        if len(use.streams) >= limits.concurrency:
            return Refusal(
                "concurrency",
                f"{len(use.streams)} requests in flight, the tenant's limit is "
                f"{limits.concurrency}",
                SLOT_RETRY_AFTER_MS,
            )
        rate_wait = use.requests.wait_s(1, now)
        if rate_wait is None or rate_wait > 0:
            return Refusal(
                "rps",
                f"above the tenant's {limits.rps:g} requests per second",
                _ms(rate_wait),
            )
        token_wait = use.tokens.wait_s(tokens, now)
        if token_wait is None:
            return Refusal(
                "tokens_per_min",
                f"asks for {tokens} tokens (prompt + max_tokens), above the tenant's "
                f"{limits.tokens_per_min} per minute: it can never be admitted",
                None,
            )
        if token_wait > 0:
            return Refusal(
                "tokens_per_min",
                f"above the tenant's {limits.tokens_per_min} tokens per minute",
                _ms(token_wait),
            )
        # Decided: charge every limit at once, so a refusal above costs nothing.
        use.requests.take(1, now)
        use.tokens.take(tokens, now)
        use.streams.add(request_id)
        self._stream_tenant[request_id] = tenant
        return None

    def release(self, request_id: str) -> None:
        """The stream ended (or was never opened): its concurrency slot is free."""
        tenant = self._stream_tenant.pop(request_id, None)
        if tenant is not None:
            self._tenants[tenant].streams.discard(request_id)

    def in_flight(self, tenant: str) -> int:
        use = self._tenants.get(tenant)
        return len(use.streams) if use else 0

    def _use(self, tenant: str, limits: TenantLimits) -> _TenantUse:
        now = self._clock()
        rate, burst = limits.rps, float(limits.request_burst)
        per_s, per_min = limits.tokens_per_min / 60.0, float(limits.tokens_per_min)
        use = self._tenants.get(tenant)
        if use is None:
            use = _TenantUse(TokenBucket(rate, burst, now), TokenBucket(per_s, per_min, now))
            self._tenants[tenant] = use
        else:
            use.requests.resize(rate, burst)
            use.tokens.resize(per_s, per_min)
        return use


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else max(1, math.ceil(seconds * 1000))
