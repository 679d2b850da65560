"""Ingest's read loop: fetch a batch of request records, hand it on, commit it once.

Caller: the ingest app, one task. Owns the consumer between polls; the rebalance listener
waits for the batch in hand, so a revoked partition is committed up to what was handed on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from services.ingest.handling import Ingest
from shared.retry import backoffs

log = structlog.get_logger()

FETCH_MS = 1000  # longest one getmany waits: the loop's only idle wake-up
MAX_RECORDS = 500  # records handed on (and committed) together at most


class RequestReader:
    """Reads `tokenbus.requests` in batches: every record of a batch ends in one outcome
    (ingest's handling) before the batch's offsets are committed."""

    def __init__(self, consumer: AIOKafkaConsumer, ingest: Ingest) -> None:
        self.consumer = consumer
        self.ingest = ingest
        self._batch = asyncio.Lock()  # held while a batch is handed on and committed

    async def run(self) -> None:
        next_wait = backoffs()
        while True:
            try:
                fetched = await self.consumer.getmany(timeout_ms=FETCH_MS, max_records=MAX_RECORDS)
            except KafkaError as exc:
                wait = next_wait()
                log.warning("requests.fetch_failed", error=repr(exc), retry_in_s=wait)
                await asyncio.sleep(wait)
                continue
            next_wait = backoffs()
            if not fetched:
                continue
            async with self._batch:
                self.ingest.telemetry.fetched(self.consumer, fetched)
                await self.ingest.handle_batch([r for rs in fetched.values() for r in rs])
                await self._commit(
                    {
                        tp: OffsetAndMetadata(rs[-1].offset + 1, "")
                        for tp, rs in fetched.items()
                        if rs
                    }
                )

    async def _commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:
            # A rebalance took the partition, or the broker is away: its new owner reads
            # these records again, and the durable memory drops what was handed on.
            log.warning("requests.commit_failed", error=repr(exc))

    def listener(self) -> ConsumerRebalanceListener:
        return _Rebalance(self._batch, self.ingest.recall)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Lets the batch in hand finish (and commit) before a partition is given up; refills
    ingest's memory before it reads any newly assigned partition."""

    def __init__(self, batch: asyncio.Lock, recall: Callable[[], Awaitable[None]]) -> None:
        self._batch = batch
        self._recall = recall

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        async with self._batch:
            return None

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        if assigned:
            await self._recall()
