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
    """Requests per second of each application, with a burst; the caller's clock.

    Caller: ingest's handling, once per record admitted from an application's topic.
    Affects: this object's buckets only.
    """

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._burst = burst
        self._buckets: dict[str, TokenBucket] = {}

    def charge(self, app: str, now: float) -> int | None:
        """Take one request from `app`'s bucket; None if it may go, else the milliseconds
        after which it may be sent again (nothing is taken then)."""
        bucket = self._buckets.get(app)
        if bucket is None:
            bucket = self._buckets[app] = TokenBucket(self._rate, self._burst, now)
        wait_s = bucket.wait_s(1, now)
        if wait_s is None or wait_s > 0:
            return math.ceil((wait_s if wait_s is not None else 1 / self._rate) * 1000)
        bucket.take(1, now)
        return None
