"""Publishing result records to a request's `reply_to`: the one place that decides where."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Collection, Set
from dataclasses import dataclass
from enum import StrEnum

from aiokafka import AIOKafkaProducer
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from shared.kafka import Headers, encode, key_of
from shared.messages import DeltaResult, DoneResult, ErrorResult, ReplyTo, ResetResult

Result = DeltaResult | DoneResult | ErrorResult | ResetResult


async def send_result(
    producer: AIOKafkaProducer,
    reply_to: ReplyTo,
    record: Result,
    headers: Headers | None = None,
) -> asyncio.Future[RecordMetadata]:
    """Queue a result record; await the returned future to know it is stored (acks=all)."""
    future: asyncio.Future[RecordMetadata] = await producer.send(
        reply_to.topic,
        encode(record),
        key=key_of(record.request_id),
        partition=reply_to.partition,
        headers=headers,
    )
    return future


class Unwritable(StrEnum):
    """Why nothing can ever be written to a `reply_to`."""

    missing = "missing"  # no such topic
    forbidden = "forbidden"  # not authorised, or internal to Kafka
    out_of_range = "out_of_range"  # no such partition


@dataclass(frozen=True)
class TargetProblem:
    kind: Unwritable
    why: str


# Names of `TOPIC_NAME`'s alphabet that Kafka refuses all the same (its `Topic.validate`);
# aiokafka's metadata leaves a refused name out, so it would read as missing.
KAFKA_REFUSED_NAMES = frozenset({".", ".."})


class ReplyTargets:
    """Whether `reply_to` targets can be written: the one check of every service that writes
    to a requester's `reply_to` (ingest, the scheduler, the workers); one per producer
    (caller: its owner; affects its own memory only).

    Known topics are answered without I/O, from the producer's metadata or from a look-up
    less than `found_s` ago (the shared results topic, which ingest never writes, costs
    nothing per record); a partition out of range there, or a topic `forget` was told of,
    is looked up afresh. An unknown one is looked up in a one-off metadata request for that
    topic alone: asking the producer itself would add it to the topics it tracks, and it
    would ask the broker for a missing topic forever after.
    A topic found missing is looked up once more after `grace_s` (one just created may not
    be in every broker's metadata yet), then remembered as missing for `remember_s`, so a
    flood of records naming it costs one wait, not one each (0: asked about every time).
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        *,
        timeout_s: float,
        grace_s: float = 0.5,
        remember_s: float = 10.0,
        found_s: float = 30.0,
        limit: int = 10_000,
    ) -> None:
        self._producer = producer
        self._timeout_s = timeout_s
        self._grace_s = grace_s
        self._remember_s = remember_s
        self._limit = limit
        self._found_s = found_s
        # topic -> (partitions, when a look-up found them); `_missing`'s are empty.
        self._found: OrderedDict[str, tuple[frozenset[int], float]] = OrderedDict()
        self._missing: OrderedDict[str, tuple[frozenset[int], float]] = OrderedDict()
        self._doubted: set[str] = set()  # topics to look up afresh (`forget`)

    async def problem(self, reply_to: ReplyTo) -> str | None:
        """Why nothing can ever be written to `reply_to` (None: it can, as far as we know).

        Raises TimeoutError or KafkaError when the cluster cannot be asked (an outage):
        that says nothing about the target.
        """
        verdict = await self.check(reply_to)
        return verdict.why if verdict is not None else None

    async def check(self, reply_to: ReplyTo) -> TargetProblem | None:
        """`problem`, with what kind of problem it is (None: it can be written)."""
        if reply_to.topic in KAFKA_REFUSED_NAMES:
            return TargetProblem(
                Unwritable.forbidden, f"reply_to topic {reply_to.topic!r} is not a valid name"
            )
        partitions = self._known(reply_to.topic)
        if partitions is not None and target_verdict(reply_to, partitions) is None:
            return None
        return await self._look_up(reply_to)

    def forget(self, topic: str) -> None:
        """After a failed write to `topic`: look it up afresh next time."""
        self._missing.pop(topic, None)
        self._found.pop(topic, None)
        self._doubted.add(topic)
        while len(self._doubted) > self._limit:
            self._doubted.pop()

    def _known(self, topic: str) -> Set[int] | None:
        """The partitions of `topic` known without I/O: from the producer's metadata, or
        found by a look-up less than `found_s` ago."""
        if topic in self._doubted:
            return None
        cluster = self._producer.client.cluster
        partitions: Set[int] | None = cluster.partitions_for_topic(topic)
        if partitions is not None and topic not in cluster.internal_topics:
            return partitions
        found = self._found.get(topic)
        if found is not None and time.monotonic() - found[1] < self._found_s:
            return found[0]
        return None

    async def _look_up(self, reply_to: ReplyTo) -> TargetProblem | None:
        topic = reply_to.topic
        now = time.monotonic()
        missing = self._missing.get(topic)
        if missing is not None and now - missing[1] < self._remember_s:
            return target_verdict(reply_to, None)
        self._missing.pop(topic, None)
        cluster = await cluster_metadata(self._producer, self._timeout_s, [topic])
        if cluster.partitions_for_topic(topic) is None and not _refused(cluster, topic):
            await asyncio.sleep(self._grace_s)
            cluster = await cluster_metadata(self._producer, self._timeout_s, [topic])
        self._doubted.discard(topic)
        if _refused(cluster, topic):
            return TargetProblem(
                Unwritable.forbidden, f"reply_to topic {topic!r} may not be written"
            )
        if topic in cluster.internal_topics:
            return TargetProblem(
                Unwritable.forbidden, f"reply_to topic {topic!r} is internal to Kafka"
            )
        partitions: Set[int] | None = cluster.partitions_for_topic(topic)
        self._found.pop(topic, None)
        remembered = self._missing if partitions is None else self._found
        remembered[topic] = (frozenset(partitions or ()), time.monotonic())
        while len(remembered) > self._limit:
            remembered.popitem(last=False)
        return target_verdict(reply_to, partitions)


def _refused(cluster: ClusterMetadata, topic: str) -> bool:
    """Whether the broker refused to describe `topic` to this principal (an ACL)."""
    return topic in cluster.unauthorized_topics


async def cluster_metadata(
    producer: AIOKafkaProducer, timeout_s: float, topics: Collection[str]
) -> ClusterMetadata:
    """A fresh view of `topics`, without adding any to those the producer tracks.

    One metadata request for just these topics (aiokafka's own `_metadata_update`, the
    call behind `fetch_all_metadata`): asking for every topic costs more the more topics
    the cluster has (ADR 0013 has the figures), once per request with per-request result
    topics.
    """
    cluster = ClusterMetadata()
    async with asyncio.timeout(timeout_s):
        updated = await producer.client._metadata_update(cluster, list(topics))
    if not updated:
        raise KafkaError("no broker answered the metadata request")
    return cluster


def target_problem(reply_to: ReplyTo, partitions: Set[int] | None) -> str | None:
    """Why `reply_to` cannot be written, given its topic's partitions (None: no such topic)."""
    verdict = target_verdict(reply_to, partitions)
    return verdict.why if verdict is not None else None


def target_verdict(reply_to: ReplyTo, partitions: Set[int] | None) -> TargetProblem | None:
    """`target_problem`, with what kind of problem it is."""
    if partitions is None:
        return TargetProblem(
            Unwritable.missing, f"reply_to topic {reply_to.topic!r} does not exist"
        )
    if reply_to.partition is not None and reply_to.partition not in partitions:
        return TargetProblem(
            Unwritable.out_of_range,
            f"reply_to partition {reply_to.partition} is out of range:"
            f" {reply_to.topic!r} has {len(partitions)} partitions",
        )
    return None


# What a failed write of a record can raise: aiokafka's errors, its bounded waits, and the
# assertion it makes on a partition its metadata does not know.
WRITE_ERRORS = (KafkaError, TimeoutError, AssertionError)
