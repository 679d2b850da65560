"""The scheduler process: tier topics in, batches out, offsets committed once handed on."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from pydantic import ValidationError

from services.scheduler.batcher import BusRule, Departure, TierPolicy
from services.scheduler.settings import SchedulerSettings
from shared.kafka import encode, make_consumer, make_producer
from shared.messages import Batch, ErrorCode, ErrorResult, QueuedRequest, Tier
from shared.offsets import OffsetTracker
from shared.results import send_result
from shared.topics import Topics

log = structlog.get_logger()

IDLE_POLL_MS = 100


@dataclass(frozen=True)
class Waiting:
    request: QueuedRequest
    tp: TopicPartition
    offset: int


class Scheduler:
    def __init__(self, settings: SchedulerSettings) -> None:
        s = settings
        self.settings = s
        self.topics = Topics(s.topic_prefix)
        self.rule: BusRule[Waiting] = BusRule(
            {
                Tier.interactive: TierPolicy(
                    s.scheduler_interactive_max_batch_size, s.scheduler_interactive_max_wait_ms
                ),
                Tier.background: TierPolicy(
                    s.scheduler_background_max_batch_size, s.scheduler_background_max_wait_ms
                ),
            }
        )
        self._offsets = OffsetTracker()

    async def run(self) -> None:
        s = self.settings
        producer = make_producer(s, client_id="scheduler")
        consumer = make_consumer(
            s, *self.topics.tiers, group_id=f"{s.topic_prefix}.scheduler", client_id="scheduler"
        )
        await producer.start()
        try:
            await consumer.start()
            log.info("scheduler.started", tiers=self.topics.tiers)
            await self._loop(consumer, producer)
        finally:
            await consumer.stop()
            await producer.stop()

    async def _loop(self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer) -> None:
        while True:
            departure = self.rule.next_departure()
            wait_ms = (
                IDLE_POLL_MS
                if departure is None
                else max(0, min(IDLE_POLL_MS, int((departure - time.time()) * 1000)))
            )
            fetched = await consumer.getmany(timeout_ms=wait_ms)
            now = time.time()
            for tp, records in fetched.items():
                for record in records:
                    self._offsets.taken(tp, record.offset)
                    await self._admit(producer, tp, record.offset, record.value or b"", now)
            for bus in self.rule.due(time.time()):
                await self._dispatch(producer, bus)
            await self._commit(consumer)

    async def _admit(
        self, producer: AIOKafkaProducer, tp: TopicPartition, offset: int, raw: bytes, now: float
    ) -> None:
        try:
            request = QueuedRequest.model_validate_json(raw)
        except ValidationError as exc:
            # Only ingest writes tier topics; a bad record here is a bug, not user input.
            log.error("tier_record.invalid", topic=tp.topic, offset=offset, error=str(exc))
            self._offsets.done(tp, offset)
            return
        deadline = request.deadline_at
        if deadline is not None and deadline <= now:
            await self._expire(producer, request)
            self._offsets.done(tp, offset)
            return
        self.rule.add(request.tier, Waiting(request, tp, offset), now)

    async def _expire(self, producer: AIOKafkaProducer, request: QueuedRequest) -> None:
        error = ErrorResult(
            request_id=request.request_id,
            attempt=request.attempt,
            seq=0,
            code=ErrorCode.deadline_exceeded,
            message=f"deadline of {request.deadline_ms} ms passed while queued",
        )
        await (await send_result(producer, request.reply_to, error))
        log.info("request.expired", request_id=request.request_id)

    async def _dispatch(self, producer: AIOKafkaProducer, bus: Departure[Waiting]) -> None:
        now = time.time()
        live: list[Waiting] = []
        for w in bus.items:
            deadline = w.request.deadline_at
            if deadline is not None and deadline <= now:
                await self._expire(producer, w.request)
                self._offsets.done(w.tp, w.offset)
            else:
                live.append(w)
        if not live:
            return
        batch = Batch(
            batch_id=uuid.uuid4().hex,
            tier=bus.tier,
            requests=[w.request for w in live],
            reason=bus.reason,
        )
        await producer.send_and_wait(self.topics.batches, encode(batch), key=batch.batch_id.encode())
        for w in live:
            self._offsets.done(w.tp, w.offset)
        log.info(
            "batch.dispatched",
            batch_id=batch.batch_id,
            tier=bus.tier.value,
            size=len(live),
            reason=bus.reason,
        )

    async def _commit(self, consumer: AIOKafkaConsumer) -> None:
        positions = self._offsets.committable()
        if positions:
            await consumer.commit(positions)
            self._offsets.mark_committed(positions)
