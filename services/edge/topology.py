"""Where an edge asks for results: its leased partition, or a topic per request."""

from __future__ import annotations

import time
from typing import Protocol

import structlog
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from services.edge.deadlines import Deadlines
from services.edge.metrics import EdgeMetrics
from services.edge.results import ResultReader
from shared.kafka import cluster_replication, new_topic
from shared.messages import ReplyTo
from shared.topics import Topics

log = structlog.get_logger()

UNKNOWN_TOPIC = 3


class TopologyError(Exception):
    """The result destination of a request could not be prepared."""


def reply_tp(reply_to: ReplyTo) -> TopicPartition:
    return TopicPartition(reply_to.topic, reply_to.partition or 0)


class ResultTopology(Protocol):
    name: str

    def known(self, request_id: str) -> tuple[ReplyTo, int] | None:
        """The destination and start offset when no Kafka call is needed (None: `open`)."""

    async def open(self, request_id: str) -> tuple[ReplyTo, int]:
        """Prepare a request's destination; return it and the offset its results start at."""

    def followed(self, reply_to: ReplyTo) -> bool:
        """True if the edge reads `reply_to` only for the requests that use it."""

    def ended(self, topic: str, now: float) -> None:
        """A request's stream ended here: what was made for it may go after retention."""

    def resumed(self, topic: str) -> None:
        """A stream is being read again: keep what was made for it."""

    async def sweep(self, now: float) -> None:
        """Remove what has outlived its retention."""


class PartitionTopology:
    """Reply partitions: one leased partition of the shared results topic for every request."""

    name = "partition"

    def __init__(self, reply_to: ReplyTo, reader: ResultReader) -> None:
        self.reply_to = reply_to
        self._reader = reader

    def known(self, request_id: str) -> tuple[ReplyTo, int]:
        # Every record of the request is written after this point is read, so resuming from
        # here replays all of it (plus other requests' records, which the router ignores).
        position = self._reader.position(reply_tp(self.reply_to))
        return self.reply_to, position or 0

    async def open(self, request_id: str) -> tuple[ReplyTo, int]:
        return self.known(request_id)

    def followed(self, reply_to: ReplyTo) -> bool:
        return False

    def ended(self, topic: str, now: float) -> None:
        pass

    def resumed(self, topic: str) -> None:
        pass

    async def sweep(self, now: float) -> None:
        pass


class TopicTopology:
    """A topic per request, created before the request is produced, deleted after retention.

    Retention starts when the stream ends on this edge; a resume inside the window finds
    the topic, a later one gets `not_found`.
    """

    name = "topic"

    def __init__(
        self,
        topics: Topics,
        admin: AIOKafkaAdminClient,
        reader: ResultReader,
        retention_s: float,
        metrics: EdgeMetrics,
    ) -> None:
        self._topics = topics
        self._admin = admin
        self._reader = reader
        self._retention_s = retention_s
        self._metrics = metrics
        self.deletions: Deadlines[str] = Deadlines()
        self._replication: int | None = None

    def known(self, request_id: str) -> None:
        return None  # its topic is created by `open`

    async def open(self, request_id: str) -> tuple[ReplyTo, int]:
        topic = self._topics.request_results(request_id)
        started = time.perf_counter()
        if self._replication is None:  # asked once: the broker count changes rarely
            self._replication = await cluster_replication(self._admin)
        response = await self._admin.create_topics([new_topic(topic, 1, self._replication)])
        self._metrics.topic_create_seconds.observe(time.perf_counter() - started)
        errors = [e for _, e, *_ in response.topic_errors if e]
        if errors:
            raise TopologyError(f"create {topic}: error codes {errors}")
        self._metrics.topics_created.inc()
        reply_to = ReplyTo(topic=topic)
        self._reader.follow(reply_tp(reply_to), 0)
        return reply_to, 0

    def followed(self, reply_to: ReplyTo) -> bool:
        return reply_to.topic.startswith(self._topics.results + ".")

    def ended(self, topic: str, now: float) -> None:
        self.deletions.set(topic, now + self._retention_s)

    def resumed(self, topic: str) -> None:
        self.deletions.cancel(topic)

    async def sweep(self, now: float) -> None:
        due = self.deletions.pop_due(now)
        if not due:
            return
        started = time.perf_counter()
        response = await self._admin.delete_topics(due)
        self._metrics.topic_delete_seconds.observe(time.perf_counter() - started)
        for topic, error, *_ in response.topic_error_codes:
            if error == 0:
                self._metrics.topics_deleted.inc()
            elif error != UNKNOWN_TOPIC:  # another edge deleted it first: fine
                log.warning("result_topic.delete_failed", topic=topic, error_code=error)
