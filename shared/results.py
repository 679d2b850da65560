"""Publishing result records to a request's `reply_to`: the one place that decides where."""

from __future__ import annotations

import asyncio
from collections.abc import Set

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


async def reply_problem(
    producer: AIOKafkaProducer, reply_to: ReplyTo, timeout_s: float
) -> str | None:
    """Why nothing can ever be written to `reply_to` (None: it can, as far as the cluster says).

    Known topics are answered from the producer's metadata, without I/O. An unknown one is
    looked up in a one-off metadata request: asking the producer itself would add the topic
    to the ones it tracks, and it would ask the broker for a missing topic forever after.
    Raises TimeoutError or KafkaError when the cluster cannot be asked (a broker outage):
    that says nothing about the target.
    """
    partitions = producer.client.cluster.partitions_for_topic(reply_to.topic)
    if partitions is None:
        cluster = await cluster_metadata(producer, timeout_s)
        partitions = cluster.partitions_for_topic(reply_to.topic)
    return target_problem(reply_to, partitions)


async def cluster_metadata(producer: AIOKafkaProducer, timeout_s: float) -> ClusterMetadata:
    """A fresh view of every topic, without adding any to those the producer tracks."""
    async with asyncio.timeout(timeout_s):
        cluster: ClusterMetadata = await producer.client.fetch_all_metadata()
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
