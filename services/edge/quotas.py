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
from shared.quotas import TokenBucket  # the one bucket rule, shared with ingest's app quotas

Limit = Literal["rps", "concurrency", "tokens_per_min", "sockets", "replays", "guided"]

# When a stream or socket ends cannot be known in advance: a hint, not a promise.
SLOT_RETRY_AFTER_MS = 1000
# A resume's replay is charged one request more per this many records it read (issue 37,
# N8): a resume far back reads up to `edge_resume_max_records` on the edge's loop. A recent
# stream's resume (an edge's death, a dropped socket) reads far fewer and costs nothing.
SCANNED_PER_REQUEST = 10_000


class TenantLimits(Model):
    """What one tenant may use of one edge; stored with the tenant in the keys file."""

    rps: float = Field(default=10.0, gt=0, description="Requests per second, sustained.")
    burst: int | None = Field(
        default=None, ge=1, description="Requests at once above the rate; unset: ceil(rps)."
    )
    concurrency: int = Field(default=32, ge=1, description="Streams in flight at once.")
    tokens_per_min: int = Field(
        default=200_000,
        ge=1,
        description="Prompt token bound + max_tokens at admission; settled to the real usage.",
    )
    sockets: int = Field(default=32, ge=1, description="WebSockets open at once.")
    replays: int = Field(
        default=4,
        ge=1,
        description="Result partitions the tenant's resumes replay at once (each replay reader"
        " of the edge's `edge_resume_replays` serves every resume of its partition).",
    )
    guided: int = Field(
        default=4,
        ge=1,
        description="Streams guided by a grammar (a JSON schema or object, a required or named"
        " tool call) in flight at once: each is a grammar the engine compiles.",
    )

    batch_tokens_per_day: int | None = Field(
        default=None,
        ge=1,
        # Unset, not written: a keys file an older edge reads stays one it takes (ADR 0072).
        exclude_if=lambda v: v is None,
        description="Tokens the tenant's batches may ask for in 24 hours (each line's prompt"
        " bound + max_tokens, counted when a batch is created, across every edge); apart from"
        " the interactive limits, which batch lines are not charged to. Unset: no limit.",
    )

    @property
    def request_burst(self) -> int:
        return self.burst if self.burst is not None else max(1, math.ceil(self.rps))


@dataclass(frozen=True)
class Refusal:
    """A limit said no: what the client is told (`rate_limited`) and when to try again.
    `never`: the request is above the limit's whole allowance, so no wait helps: the client
    is told it is invalid (`invalid_request`), not to retry."""

    limit: Limit
    message: str
    retry_after_ms: int | None
    never: bool = False


@dataclass
class _TenantUse:
    requests: TokenBucket
    tokens: TokenBucket
    streams: set[str] = field(default_factory=set)
    guided: set[str] = field(default_factory=set)  # those of `streams` a grammar guides
    sockets: int = 0
    replays: dict[str, int] = field(default_factory=dict)  # partition -> resumes reading it


class Quotas:
    """Every tenant's use of this edge, checked against the limits the caller passes in.

    Caller: the edge's sockets, all on one event loop (no locks).
    Affects: only its own counters; `admit` counts a stream until `release(request_id)`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _TenantUse] = {}
        self._stream_tenant: dict[str, str] = {}
        self._charged: dict[str, int] = {}  # request_id -> tokens charged at `admit`

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
        self, tenant: str, limits: TenantLimits, request_id: str, tokens: int, guided: bool = False
    ) -> Refusal | None:
        """Charge one request of `tokens` (prompt bound + max_tokens), or refuse it whole;
        `settle` corrects the charge to the real usage once the request ends. `guided`: a
        grammar guides it (one of the tenant's `guided` places, issue 37, N2)."""
        now = self._clock()
        use = self._use(tenant, limits)
        if full := _no_stream_slot(use, limits):
            return full
        if guided and len(use.guided) >= limits.guided:
            return Refusal(
                "guided",
                f"{len(use.guided)} streams guided by a grammar in flight, the tenant's limit"
                f" is {limits.guided}",
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
                f"prompt plus max_tokens is {tokens} tokens, above the tenant's "
                f"{limits.tokens_per_min} tokens per minute: it can never be admitted;"
                " lower max_tokens or shorten the prompt",
                None,
                never=True,
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
        if guided:
            use.guided.add(request_id)
        self._stream_tenant[request_id] = tenant
        self._charged[request_id] = tokens
        return None

    def charge(self, tenant: str, limits: TenantLimits) -> Refusal | None:
        """Charge one request's worth of the rate for a frame that opens no stream (a resume,
        a cancel): each writes to Kafka or reads the log, so none is free."""
        now = self._clock()
        use = self._use(tenant, limits)
        wait = use.requests.wait_s(1, now)
        if wait is None or wait > 0:
            return Refusal(
                "rps", f"above the tenant's {limits.rps:g} requests per second", _ms(wait)
            )
        use.requests.take(1, now)
        return None

    def start_replay(self, tenant: str, limits: TenantLimits, partition: str) -> Refusal | None:
        """A resume's replay of `partition` (its topic and number), until `end_replay`: the
        tenant's resumes read at most `replays` partitions at once, so one tenant cannot take
        every replay reader of the edge; resumes of a partition it reads already share it."""
        use = self._use(tenant, limits)
        if partition not in use.replays and len(use.replays) >= limits.replays:
            return Refusal(
                "replays",
                f"the tenant's resumes replay {len(use.replays)} partitions, its limit is"
                f" {limits.replays}",
                SLOT_RETRY_AFTER_MS,
            )
        use.replays[partition] = use.replays.get(partition, 0) + 1
        return None

    def end_replay(self, tenant: str, partition: str, scanned: int) -> None:
        """The replay is over, having read `scanned` records: its place is free, and the
        tenant's request rate is charged one request per `SCANNED_PER_REQUEST` of them (a
        debt its next requests wait out)."""
        use = self._tenants.get(tenant)
        if use is None:
            return
        left = use.replays.get(partition, 0) - 1
        if left > 0:
            use.replays[partition] = left
        else:
            use.replays.pop(partition, None)
        if cost := scanned // SCANNED_PER_REQUEST:
            use.requests.take(cost, self._clock())

    def hold(self, tenant: str, limits: TenantLimits, request_id: str) -> Refusal | None:
        """A concurrency slot for a stream that came here by a resume (no tokens: they were
        charged where it was opened); a stream already counted here keeps its slot."""
        use = self._use(tenant, limits)
        if request_id in use.streams:
            return None
        if full := _no_stream_slot(use, limits):
            return full
        use.streams.add(request_id)
        self._stream_tenant[request_id] = tenant
        return None

    def release(self, request_id: str) -> None:
        """The stream ended (or was never opened): its concurrency slot is free."""
        self._charged.pop(request_id, None)
        tenant = self._stream_tenant.pop(request_id, None)
        if tenant is not None:
            self._tenants[tenant].streams.discard(request_id)
            self._tenants[tenant].guided.discard(request_id)

    def settle(self, request_id: str, used_tokens: int) -> None:
        """The request ended with its real usage (prompt + completion tokens of its final
        `done`): its tenant gets back what `admit` charged above that, or pays what it used
        beyond it. Once per request, and only for one admitted here (a stream resumed from
        another edge was charged there); `release` still frees its slot."""
        charged = self._charged.pop(request_id, None)
        tenant = self._stream_tenant.get(request_id)
        if charged is None or tenant is None:
            return
        # A negative take gives back; the bucket's next fill caps it at its capacity.
        self._tenants[tenant].tokens.take(used_tokens - charged, self._clock())

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


def _no_stream_slot(use: _TenantUse, limits: TenantLimits) -> Refusal | None:
    if len(use.streams) < limits.concurrency:
        return None
    return Refusal(
        "concurrency",
        f"{len(use.streams)} requests in flight, the tenant's limit is {limits.concurrency}",
        SLOT_RETRY_AFTER_MS,
    )


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else max(1, math.ceil(seconds * 1000))
