"""The worker process: takes batches, runs them on the engine, obeys cancels, heartbeats."""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError
from pydantic import ValidationError

from services.worker.engines.base import Engine
from services.worker.runner import RequestRunner
from services.worker.settings import WorkerSettings
from shared.kafka import encode, make_consumer, make_producer
from shared.messages import Batch, CancelRecord, Heartbeat
from shared.offsets import OffsetTracker
from shared.topics import Topics

log = structlog.get_logger()

HEARTBEAT_SECONDS = 1.0


class Worker:
    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.topics = Topics(settings.topic_prefix)
        self._offsets = OffsetTracker()
        self._commit_lock = asyncio.Lock()

    async def run(self) -> None:
        s = self.settings
        producer = make_producer(s, client_id=f"worker-{s.worker_id}")
        batches = make_consumer(
            s, self.topics.batches, group_id=f"{s.topic_prefix}.workers", client_id=s.worker_id
        )
        # Every worker sees every cancel: no group, from the live end.
        control = make_consumer(
            s,
            self.topics.control,
            group_id=None,
            client_id=f"{s.worker_id}-control",
            auto_offset_reset="latest",
        )
        await producer.start()
        try:
            await control.start()
            await batches.start()
            await self.engine.start()
            runner = RequestRunner(self.engine, producer, s.worker_flush_ms, s.worker_flush_tokens)
            log.info("worker.started", worker_id=s.worker_id, engine=self.engine.name)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._take_batches(batches, runner, tg))
                tg.create_task(self._obey_cancels(control))
                tg.create_task(self._heartbeat(producer))
        finally:
            await self.engine.stop()
            await batches.stop()
            await control.stop()
            await producer.stop()

    async def _take_batches(
        self, consumer: AIOKafkaConsumer, runner: RequestRunner, tg: asyncio.TaskGroup
    ) -> None:
        while True:
            fetched = await consumer.getmany(timeout_ms=1000)
            for tp, records in fetched.items():
                for record in records:
                    self._offsets.taken(tp, record.offset)
                    try:
                        batch = Batch.model_validate_json(record.value or b"")
                    except ValidationError as exc:
                        log.error("batch.invalid", offset=record.offset, error=str(exc))
                        await self._done(consumer, tp, record.offset)
                        continue
                    tg.create_task(self._run_batch(consumer, runner, batch, tp, record.offset))

    async def _run_batch(
        self,
        consumer: AIOKafkaConsumer,
        runner: RequestRunner,
        batch: Batch,
        tp: TopicPartition,
        offset: int,
    ) -> None:
        log.info("batch.started", batch_id=batch.batch_id, size=len(batch.requests))
        results = await asyncio.gather(
            *(runner.run(r, len(batch.requests)) for r in batch.requests), return_exceptions=True
        )
        for request, result in zip(batch.requests, results, strict=True):
            if isinstance(result, BaseException):
                log.error(
                    "request.failed", request_id=request.request_id, error=repr(result)
                )
        await self._done(consumer, tp, offset)

    async def _done(self, consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> None:
        self._offsets.done(tp, offset)
        async with self._commit_lock:
            positions = self._offsets.committable()
            if not positions:
                return
            try:
                await consumer.commit(positions)
                self._offsets.mark_committed(positions)
            except (CommitFailedError, IllegalStateError) as exc:
                # The partition moved to another worker, which will run the batch again.
                log.warning("commit.failed", error=str(exc))
                self._offsets.forget(set(positions))

    async def _obey_cancels(self, consumer: AIOKafkaConsumer) -> None:
        async for record in consumer:
            try:
                cancel = CancelRecord.model_validate_json(record.value or b"")
            except ValidationError as exc:
                log.error("control.invalid", offset=record.offset, error=str(exc))
                continue
            await self.engine.abort(cancel.request_id)

    async def _heartbeat(self, producer: AIOKafkaProducer) -> None:
        while True:
            cap = self.engine.capacity()
            beat = Heartbeat(
                worker_id=self.settings.worker_id,
                model=self.settings.worker_model,
                total_slots=cap.total_slots,
                free_slots=cap.free_slots,
                running=cap.running,
                queued_tokens=cap.queued_tokens,
                utilisation=min(1.0, cap.utilisation),
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await producer.send(
                    self.topics.workers, encode(beat), key=self.settings.worker_id.encode()
                )
            await asyncio.sleep(HEARTBEAT_SECONDS)
