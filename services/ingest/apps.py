"""Outside applications: who wrote a record (the topic it was read from) and each one's quota.

An application writes to its own requests topic, which only its Kafka principal may WRITE
(`tokenbus topics create --acls --app NAME`), so the topic names the writer: its tenant,
its reply topic and its request-id scope come from there, never from the record (ADR 0044).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from shared.quotas import TokenBucket
from shared.topics import Topics

# Between an application's name and its own request id in the id the pipeline carries.
SCOPE_SEPARATOR = ":"


@dataclass(frozen=True)
class App:
    """One outside application, as ingest knows it from its configured name."""

    name: str
    requests: str  # the topic it writes, and only it
    replies: str  # the topic its results and errors go to, and only it reads

    @property
    def tenant(self) -> str:
        """Its tenant: its name, whatever its records claim (fair share, cache, quotas)."""
        return self.name

    def scoped(self, request_id: str) -> str:
        """The id the pipeline knows its request by: unique across tenants, since no other
        writer's ids carry this application's name first (the edge's are uuid hex)."""
        return f"{self.name}{SCOPE_SEPARATOR}{request_id}"


class Apps:
    """The configured applications, found by the topic a record was read from."""

    def __init__(self, topics: Topics, names: Iterable[str]) -> None:
        self._by_topic = {
            topics.app_requests(name): App(
                name, topics.app_requests(name), topics.app_replies(name)
            )
            for name in names
        }

    def of_topic(self, topic: str) -> App | None:
        """The application whose topic this is; None for the shared requests topic."""
        return self._by_topic.get(topic)

    @property
    def topics(self) -> list[str]:
        return sorted(self._by_topic)


class AppQuotas:
    """Each application's records per second and bytes per second, each with a burst; the
    caller's clock.

    Caller: ingest's handling, once per record read from an application's topic, before it
    is parsed (a record refused here costs no parse; issue 37, N6).
    Affects: this object's buckets only.
    """

    def __init__(
        self, rate: float, burst: int, bytes_per_s: float = math.inf, burst_bytes: int = 0
    ) -> None:
        self._rate, self._burst = rate, burst
        self._bytes_per_s, self._burst_bytes = bytes_per_s, burst_bytes
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket | None]] = {}

    def charge(self, app: str, now: float, size: int = 0) -> int | None:
        """Take one record of `size` bytes from `app`'s buckets; None if it may go, else the
        milliseconds after which it may be sent again (nothing is taken then)."""
        buckets = self._buckets.get(app)
        if buckets is None:
            by_bytes = (
                TokenBucket(self._bytes_per_s, self._burst_bytes, now)
                if math.isfinite(self._bytes_per_s)
                else None
            )
            buckets = self._buckets[app] = (TokenBucket(self._rate, self._burst, now), by_bytes)
        records, by_bytes = buckets
        waits = [_wait_s(records, 1, self._rate, now)]
        if by_bytes is not None:
            waits.append(_wait_s(by_bytes, size, self._bytes_per_s, now))
        wait_s = max(waits)
        if wait_s > 0:
            return math.ceil(wait_s * 1000)
        records.take(1, now)
        if by_bytes is not None:
            by_bytes.take(size, now)
        return None


def _wait_s(bucket: TokenBucket, amount: int, rate: float, now: float) -> float:
    """How long until `bucket` holds `amount`; more than its burst: as long as `amount`
    takes to earn at `rate` (it is refused each time, and told to slow down)."""
    wait_s = bucket.wait_s(amount, now)
    return wait_s if wait_s is not None else amount / rate
