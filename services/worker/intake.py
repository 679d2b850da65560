"""How a worker receives the batches addressed to it, and what its heartbeat says about them.

The worker reads one partition of the batches topic (`worker_batch_partition`), assigned,
not through a group rebalance, and commits its progress under a group of its own
(`Topics.worker_group`), so a scheduler can hand back a dead worker's unfinished batches
from that committed offset. Batches addressed to another worker id are skipped. The
heartbeat reports the partition, how far the worker has read (`batches_consumed`, the
scheduler's acknowledgement) and the (request_id, attempt) of every request it holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import ConsumerRecord
from pydantic import ValidationError

from services.worker.settings import WorkerSettings
from shared.kafka import make_consumer
from shared.messages import Batch, QueuedRequest
from shared.offsets import OffsetTracker
from shared.topics import Topics

log = structlog.get_logger()

FETCH_MS = 1000


class BatchIntake:
    """The worker's batch partition: reading, holding, committing."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        topics = Topics(settings.topic_prefix)
        self.tp = TopicPartition(topics.batches, settings.worker_batch_partition)
        self.group = topics.worker_group(settings.worker_id)
        self.started_at = time.time()
        self.consumed = 0  # next offset to read: every batch below is in our hands
        self.freed = asyncio.Event()  # a held request finished: worth a heartbeat soon
        self._held: dict[tuple[str, int], None] = {}
        self._offsets = OffsetTracker()
        self._commit_lock = asyncio.Lock()
        self._replay_below = 0  # batches below were taken by a previous process of this id

    def consumer(self) -> AIOKafkaConsumer:
        # A new worker id starts at the live end: nothing was addressed to it before its
        # first heartbeat, which comes after `start` has committed that position.
        return make_consumer(
            self.settings,
            group_id=self.group,
            client_id=self.worker_id,
            auto_offset_reset="latest",
        )

    async def start(self, consumer: AIOKafkaConsumer) -> None:
        """Assign our partition; commit where we start so a recovery has a lower bound."""
        consumer.assign([self.tp])
        position = await consumer.position(self.tp)
        end = (await consumer.end_offsets([self.tp]))[self.tp]
        # Batches between our committed offset and today's end were addressed to a former
        # process with this id (not recovered yet): it may have streamed part of them, so
        # they run again as the next attempt.
        self._replay_below = end
        await consumer.commit({self.tp: position})
        self.consumed = position
        log.info(
            "intake.started",
            worker_id=self.worker_id,
            partition=self.tp.partition,
            position=position,
            replay=max(0, end - position),
        )

    async def take(
        self, consumer: AIOKafkaConsumer
    ) -> list[tuple[ConsumerRecord[bytes, bytes], Batch]]:
        """The next batches addressed to us, each request now held; others are skipped."""
        fetched = await consumer.getmany(self.tp, timeout_ms=FETCH_MS)
        out: list[tuple[ConsumerRecord[bytes, bytes], Batch]] = []
        for record in fetched.get(self.tp, []):
            self._offsets.taken(self.tp, record.offset)
            self.consumed = max(self.consumed, record.offset + 1)
            try:
                batch = Batch.model_validate_json(record.value or b"")
            except ValidationError as exc:
                log.error("batch.invalid", offset=record.offset, error=str(exc))
                await self.done(consumer, record.offset)
                continue
            if batch.worker_id not in (None, self.worker_id):
                await self.done(consumer, record.offset)
                continue
            if record.offset < self._replay_below:
                batch = _next_attempts(batch)
            for request in batch.requests:
                self._held[(request.request_id, request.attempt)] = None
            out.append((record, batch))
        return out

    def finished(self, request: QueuedRequest) -> None:
        """The request is answered or handed back: we no longer hold it."""
        if self._held.pop((request.request_id, request.attempt), 0) is None:
            self.freed.set()

    def held(self) -> list[tuple[str, int]]:
        return list(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._held)

    async def done(self, consumer: AIOKafkaConsumer, offset: int) -> None:
        """Every request of the batch at `offset` is answered or handed back: commit past it."""
        self._offsets.done(self.tp, offset)
        async with self._commit_lock:
            positions = self._offsets.committable()
            if not positions:
                return
            try:
                await consumer.commit(positions)
                self._offsets.mark_committed(positions)
            except (CommitFailedError, IllegalStateError) as exc:
                # Kept for the next batch's commit; a recovery reads from the older offset.
                log.warning("commit.failed", error=str(exc))


def _next_attempts(batch: Batch) -> Batch:
    requests = [r.model_copy(update={"attempt": r.attempt + 1}) for r in batch.requests]
    return batch.model_copy(update={"requests": requests})
