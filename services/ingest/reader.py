"""Ingest's read loop: fetch a batch of request records, hand it on, commit on an interval.

Caller: the ingest app, one task. Owns the consumer between polls; the rebalance listener
waits for the batch in hand, so a revoked partition is committed up to what was handed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from services.ingest.handling import Ingest
from shared.fetches import fetches
from shared.health import Readiness, consumer_readiness
from shared.rebalance import Rebalance

log = structlog.get_logger()

FETCH_MS = 1000  # longest one getmany waits: the loop's only idle wake-up
MAX_RECORDS = 500  # records handed on (and committed) together at most


class RequestReader:
    """Reads `tokenbus.requests` in batches: every record of a batch ends in one outcome
    (ingest's handling) before its offset may be committed.

    Commits are batched too, at most one per `ingest_commit_interval_ms`: a crash re-reads
    what was handed on since the last commit, and the durable memory drops it again.
    """

    def __init__(
        self, consumer: AIOKafkaConsumer, ingest: Ingest, commit_interval_s: float
    ) -> None:
        self.consumer = consumer
        self.ingest = ingest
        self._commit_interval_s = commit_interval_s
        self._batch = asyncio.Lock()  # held while a batch is handed on, and by a revocation
        self._handed_on: dict[TopicPartition, int] = {}  # next offset to commit, per partition
        self._last_commit = 0.0

    async def run(self) -> None:
        consumer = self.consumer
        lag = self.ingest.telemetry.metrics.lag
        try:
            async for fetched in fetches(
                consumer, what="requests", timeout_ms=FETCH_MS, max_records=MAX_RECORDS, lag=lag
            ):
                async with self._batch:
                    if fetched:
                        records = [r for rs in fetched.values() for r in rs]
                        await self.ingest.handle_batch(records)
                        owned = consumer.assignment()
                        for tp, rs in fetched.items():
                            if rs and tp in owned:  # else revoked meanwhile: not ours to commit
                                self._handed_on[tp] = rs[-1].offset + 1
                    if time.monotonic() - self._last_commit >= self._commit_interval_s:
                        await self._commit(set(self._handed_on))
        finally:
            with contextlib.suppress(KafkaError):  # shutting down: at worst, read again
                await self._commit(set(self._handed_on))

    async def _commit(self, partitions: set[TopicPartition]) -> None:
        """Commit what was handed on of `partitions`. Caller holds `_batch`."""
        self._last_commit = time.monotonic()
        offsets = {
            tp: OffsetAndMetadata(self._handed_on.pop(tp), "")
            for tp in partitions
            if tp in self._handed_on
        }
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:
            # A rebalance took the partition, or the broker is away: its next owner reads
            # these records again, and the durable memory drops what was handed on.
            log.warning("requests.commit_failed", error=repr(exc))

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        """Let the batch in hand finish, then commit what was handed on of `partitions`."""
        async with self._batch:
            await self._commit(partitions)

    async def readiness(self) -> Readiness:
        """`/readyz` (shared/health.py): request partitions assigned, broker answering."""
        return await consumer_readiness([self.consumer])

    def listener(self) -> ConsumerRebalanceListener:
        """Commits what was handed on before a partition is given up; refills ingest's
        memory before it reads any newly assigned partition."""
        return Rebalance(revoked=self.revoked, assigned=self._recall_for)

    async def _recall_for(self, assigned: set[TopicPartition]) -> None:
        if assigned:
            await self.ingest.recall()
