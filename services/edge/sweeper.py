"""Deletes per-request result topics that no edge will delete: a crashed edge's leftovers.

An edge deletes its own per-request topics a retention window after their streams end
(`topology.TopicTopology`). An edge killed before that leaves them for good. Every edge
therefore sweeps: it lists `<prefix>.results.<request_id>` topics, and deletes those it does
not read itself whose last record is older than `orphan_after_s` (or, for a topic still
empty, that it first saw that long ago). A live stream is written to at least every few
seconds, and a finished one is deleted by its own edge after the (shorter) retention, so what
the rule finds is what nobody else will delete. Several edges sweeping the same topic is
harmless: the second delete finds nothing.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from services.edge.metrics import EdgeMetrics
from shared.kafka import make_consumer
from shared.settings import TokenbusSettings
from shared.topics import Topics

log = structlog.get_logger()

UNKNOWN_TOPIC = 3
# A look at the candidates' offsets waits this long at most (`TopicSweeper._look`).
LOOK_TIMEOUT_S = 5.0
# Only what an edge makes: `tokenbus.results.<uuid4 hex>` (never the lease log).
_REQUEST_TOPIC_SUFFIX = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Sighting:
    """What one listing showed of one per-request topic."""

    end_offset: int
    written_since_cutoff: bool  # a record at or after `now - orphan_after_s`


class OrphanBook:
    """Pure: which listed topics are orphans, by the caller's clock.

    Caller: `TopicSweeper.sweep`, once per listing.
    Affects: when each empty topic was first seen (forgotten once it is no longer listed).
    """

    def __init__(self, orphan_after_s: float) -> None:
        self.orphan_after_s = orphan_after_s
        self._first_seen: dict[str, float] = {}

    def due(self, now: float, seen: Mapping[str, Sighting]) -> list[str]:
        for topic in [t for t in self._first_seen if t not in seen]:
            del self._first_seen[topic]
        out: list[str] = []
        for topic, sighting in sorted(seen.items()):
            first = self._first_seen.setdefault(topic, now)
            if sighting.written_since_cutoff:
                continue
            if sighting.end_offset > 0 or now - first >= self.orphan_after_s:
                out.append(topic)
        return out


def request_topic(topics: Topics, name: str) -> bool:
    """True if `name` is a per-request result topic an edge made."""
    head = topics.results + "."
    return name.startswith(head) and bool(_REQUEST_TOPIC_SUFFIX.match(name[len(head) :]))


class TopicSweeper:
    """Owns one sweep loop; `mine(topic)` names the topics this edge reads or will delete."""

    def __init__(
        self,
        admin: AIOKafkaAdminClient,
        settings: TokenbusSettings,
        topics: Topics,
        mine: Callable[[str], bool],
        metrics: EdgeMetrics,
        orphan_after_s: float,
        interval_s: float,
    ) -> None:
        self._admin = admin
        self._settings = settings
        self._topics = topics
        self._mine = mine
        self._metrics = metrics
        self._interval_s = interval_s
        self.book = OrphanBook(orphan_after_s)

    async def run(self) -> None:
        while True:
            # Jitter, so edges started together do not all list and delete at once.
            await asyncio.sleep(self._interval_s * random.uniform(0.75, 1.25))
            try:
                await self.sweep(time.time())
            except (KafkaError, TimeoutError) as exc:
                # The broker is away or busy: the next round tries again.
                log.warning("result_topics.sweep_failed", error=repr(exc))

    async def sweep(self, now: float) -> list[str]:
        """One round: list, look at the candidates' last writes, delete the orphans."""
        listed = await self._admin.list_topics()
        candidates = [t for t in listed if request_topic(self._topics, t) and not self._mine(t)]
        seen = await self._look(candidates, now) if candidates else {}
        due = self.book.due(now, seen)
        if not due:
            return []
        response = await self._admin.delete_topics(due)
        deleted: list[str] = []
        for topic, error, *_ in response.topic_error_codes:
            if error == 0:
                deleted.append(topic)
                self._metrics.topics_swept.inc()
            elif error != UNKNOWN_TOPIC:  # another edge swept it first: fine
                log.warning("result_topic.sweep_failed", topic=topic, error_code=error)
        log.info("result_topics.swept", count=len(deleted), topics=deleted[:20])
        return deleted

    async def _look(self, names: list[str], now: float) -> dict[str, Sighting]:
        """Each listed topic's end and whether it was written since the orphan cutoff.

        A topic deleted since the listing (another edge swept it, or its own edge deleted it
        at retention) holds aiokafka's lookup until its request timeout (40 s): the round
        stalled, and a stream that ended meanwhile was seen as an orphan. Bounded: past
        `LOOK_TIMEOUT_S` the topics still listed are looked at once more; past it again the
        round gives up (the next one tries again).
        """
        try:
            return await asyncio.wait_for(self._sightings(names, now), LOOK_TIMEOUT_S)
        except TimeoutError:
            still = set(await self._admin.list_topics())
            left = [name for name in names if name in still]
            log.info("result_topics.look_again", gone=len(names) - len(left))
            return (
                await asyncio.wait_for(self._sightings(left, now), LOOK_TIMEOUT_S) if left else {}
            )

    async def _sightings(self, names: list[str], now: float) -> dict[str, Sighting]:
        cutoff_ms = int((now - self.book.orphan_after_s) * 1000)
        tps = [TopicPartition(name, 0) for name in names]
        consumer = make_consumer(self._settings, group_id=None, client_id="edge-sweeper")
        await consumer.start()
        try:
            ends = await consumer.end_offsets(tps)
            recent = await consumer.offsets_for_times(dict.fromkeys(tps, cutoff_ms))
        finally:
            await consumer.stop()
        return {
            tp.topic: Sighting(ends.get(tp, 0), recent.get(tp) is not None)
            for tp in tps
            if tp in ends
        }
