"""How a service reads Kafka for its whole life: `fetches`, and `reads` beneath it.

Every long-lived reader loops the same way: read; on a Kafka error (a broker away, a
rebalance under way) log `<what>.fetch_failed`, back off and read again, never give up; on
success start the backoff over and record the consumer's lag. These iterators own that
loop; the reader owns only what it does with what was read, as aiokafka's fetcher owns
fetching and leaves records to the caller.

    async for fetched in fetches(consumer, what="tiers", lag=metrics.lag):
        ...  # every fetch, the empty ones too: a loop may act on time as well as records
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from shared.metrics import ConsumerLag
from shared.retry import Backoff

log = structlog.get_logger()

T = TypeVar("T")
Fetched = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]


async def reads(read: Callable[[], Awaitable[T]], *, what: str) -> AsyncIterator[T]:
    """What each `read()` returns, for ever; a Kafka error is logged and retried."""
    backoff = Backoff()
    while True:
        try:
            got = await read()
        except KafkaError as exc:
            wait = backoff.next()
            log.warning(f"{what}.fetch_failed", error=repr(exc), retry_in_s=wait)
            await asyncio.sleep(wait)
            continue
        backoff.reset()
        yield got


async def fetches(
    consumer: AIOKafkaConsumer,
    *partitions: TopicPartition,
    what: str,
    timeout_ms: int,
    max_records: int | None = None,
    lag: ConsumerLag | None = None,
) -> AsyncIterator[Fetched]:
    """Each `getmany` of `consumer` (of `partitions`, or all it is assigned), for ever.

    `timeout_ms` is the longest one fetch waits when nothing comes: the loop's idle wake-up.
    `lag`, if given, records the consumer's lag and each record's delay after every fetch.
    """

    async def fetch() -> Fetched:
        fetched: Fetched = await consumer.getmany(
            *partitions, timeout_ms=timeout_ms, max_records=max_records
        )
        return fetched

    async for fetched in reads(fetch, what=what):
        if fetched and lag is not None:
            lag.observe(consumer, fetched)
        yield fetched
