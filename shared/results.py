"""Publishing result records to a request's `reply_to`: the one place that decides where."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Collection, Set

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


class ReplyTargets:
    """Whether `reply_to` targets can be written; one per producer (caller: its owner).

    Known topics are answered from the producer's metadata, without I/O. An unknown one is
    looked up in a one-off metadata request for that topic alone: asking the producer
    itself would add it to the topics it tracks, and it would ask the broker for a missing
    topic forever after.
    A topic found missing is looked up once more after `grace_s` (one just created may not
    be in every broker's metadata yet), then remembered as missing for `remember_s`, so a
    flood of records naming it costs one wait, not one each.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        *,
        timeout_s: float,
        grace_s: float = 0.5,
        remember_s: float = 10.0,
        limit: int = 10_000,
    ) -> None:
        self._producer = producer
        self._timeout_s = timeout_s
        self._grace_s = grace_s
        self._remember_s = remember_s
        self._limit = limit
        self._missing: OrderedDict[str, float] = OrderedDict()  # topic -> found missing at

    async def problem(self, reply_to: ReplyTo) -> str | None:
        """Why nothing can ever be written to `reply_to` (None: it can, as far as we know).

        Raises TimeoutError or KafkaError when the cluster cannot be asked (an outage):
        that says nothing about the target.
        """
        topic = reply_to.topic
        partitions = self._producer.client.cluster.partitions_for_topic(topic)
        if partitions is None:
            partitions = await self._look_up(topic)
        return target_problem(reply_to, partitions)

    async def _look_up(self, topic: str) -> Set[int] | None:
        now = time.monotonic()
        found_at = self._missing.get(topic)
        if found_at is not None and now - found_at < self._remember_s:
            return None
        self._missing.pop(topic, None)
        cluster = await cluster_metadata(self._producer, self._timeout_s, [topic])
        partitions: Set[int] | None = cluster.partitions_for_topic(topic)
        if partitions is None:
            await asyncio.sleep(self._grace_s)
            cluster = await cluster_metadata(self._producer, self._timeout_s, [topic])
            partitions = cluster.partitions_for_topic(topic)
        if partitions is None:
            self._missing[topic] = time.monotonic()
            while len(self._missing) > self._limit:
                self._missing.popitem(last=False)
        return partitions


async def cluster_metadata(
    producer: AIOKafkaProducer, timeout_s: float, topics: Collection[str]
) -> ClusterMetadata:
    """A fresh view of `topics`, without adding any to those the producer tracks.

    One metadata request for just these topics (aiokafka's own `_metadata_update`, the
    call behind `fetch_all_metadata`): asking for every topic costs 50-100 ms on a broker
    with a thousand topics, once per request with per-request result topics.
    """
    cluster = ClusterMetadata()
    async with asyncio.timeout(timeout_s):
        updated = await producer.client._metadata_update(cluster, list(topics))
    if not updated:
        raise KafkaError("no broker answered the metadata request")
    return cluster


def target_problem(reply_to: ReplyTo, partitions: Set[int] | None) -> str | None:
    """Why `reply_to` cannot be written, given its topic's partitions (None: no such topic)."""
    if partitions is None:
        return f"reply_to topic {reply_to.topic!r} does not exist"
    if reply_to.partition is not None and reply_to.partition not in partitions:
        return (
            f"reply_to partition {reply_to.partition} is out of range:"
            f" {reply_to.topic!r} has {len(partitions)} partitions"
        )
    return None


# What a failed write of a record can raise: aiokafka's errors, its bounded waits, and the
# assertion it makes on a partition its metadata does not know.
WRITE_ERRORS = (KafkaError, TimeoutError, AssertionError)
