"""The worker process: takes batches, runs them on the engine, obeys cancels, heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import TypeAdapter, ValidationError

from services.worker.cancel import CancelBook, apply_cancel
from services.worker.drain import Drain, hand_back
from services.worker.engines.base import Engine
from services.worker.intake import BatchIntake
from services.worker.runner import RequestRunner, RunOutcome
from services.worker.settings import WorkerSettings
from services.worker.telemetry import batch_received, observe_capacity, run_traced
from shared.kafka import encode, make_consumer, make_producer
from shared.messages import (
    Batch,
    CancelRecord,
    ControlRecord,
    ErrorCode,
    ErrorResult,
    Heartbeat,
    QueuedRequest,
)
from shared.results import send_result
from shared.telemetry import carrier
from shared.topics import Topics

log = structlog.get_logger()

_control_records: TypeAdapter[ControlRecord] = TypeAdapter(ControlRecord)

# After a slot frees, the next heartbeat goes out this soon (not sooner), so schedulers
# refill the slot without waiting for the regular interval.
HEARTBEAT_MIN_GAP_S = 0.05


class Worker:
    def __init__(
        self, settings: WorkerSettings, engine: Engine, *, drain_on_sigterm: bool = True
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.topics = Topics(settings.topic_prefix)
        self.intake = BatchIntake(settings)
        self.drain = Drain(settings.worker_drain_timeout_s)
        self._drain_on_sigterm = drain_on_sigterm
        self._batch_tasks: set[asyncio.Task[None]] = set()
        # batch_id -> offsets of copies delivered again while it runs here (a rebalance
        # rewinds to the last commit, which is behind batches still in flight).
        self._redelivered: dict[str, list[tuple[TopicPartition, int]]] = {}
        self._early_cancels = CancelBook()
        self._producer_failed = asyncio.Event()

    async def run(self) -> None:
        s = self.settings
        producer = make_producer(s, client_id=f"worker-{s.worker_id}")
        batches = self.intake.consumer()
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
            await self.intake.start(batches)
            await self.engine.start()
            runner = RequestRunner(
                self.engine,
                producer,
                s.worker_flush_ms,
                s.worker_flush_tokens,
                s.worker_flush_first,
            )
            self._producer = producer
            self._runner = runner
            if self._drain_on_sigterm:
                # SIGTERM drains (SIGINT still cancels at once, via run_service).
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.drain.signal)
            log.info("worker.started", worker_id=s.worker_id, engine=self.engine.name)
            async with asyncio.TaskGroup() as tg:
                taker = tg.create_task(self._take_batches(batches, runner, tg))
                others = [
                    tg.create_task(self._obey_cancels(control)),
                    tg.create_task(self._heartbeat()),
                    tg.create_task(self._replace_broken_producer()),
                ]
                await self.drain.requested.wait()
                taker.cancel()
                await self._send_heartbeat()  # tell schedulers: no free slots here
                await self.drain.run(self._batch_tasks, lambda: runner.running, runner.hand_back)
                for task in others:
                    task.cancel()
            log.info("worker.drained", worker_id=s.worker_id)
        finally:
            await self.engine.stop()
            await batches.stop()
            await control.stop()
            await self._producer.stop()

    async def _take_batches(
        self, consumer: AIOKafkaConsumer, runner: RequestRunner, tg: asyncio.TaskGroup
    ) -> None:
        tp = self.intake.tp
        while True:
            for record, batch in await self.intake.take(consumer):
                batch_received(batch, record, consumer, tp)
                if batch.batch_id in self._redelivered:
                    # Running it twice would stream the same attempt twice, chunked
                    # differently: finish the copy with the run already under way.
                    log.info("batch.redelivered", batch_id=batch.batch_id, offset=record.offset)
                    self._redelivered[batch.batch_id].append((tp, record.offset))
                    continue
                self._redelivered[batch.batch_id] = []
                task = tg.create_task(self._run_batch(consumer, runner, batch, tp, record.offset))
                self._batch_tasks.add(task)
                task.add_done_callback(self._batch_tasks.discard)

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
            *(
                run_traced(r, batch, self._run_held(runner, r, len(batch.requests)))
                for r in batch.requests
            ),
            return_exceptions=True,
        )
        for request, result in zip(batch.requests, results, strict=True):
            if isinstance(result, BaseException):
                log.error("request.failed", request_id=request.request_id, error=repr(result))
            elif result == "handed_back":
                await hand_back(self._producer, self.topics, request)
                self.intake.finished(request)
        for copy_tp, copy_offset in self._redelivered.pop(batch.batch_id, []):
            await self._done(consumer, copy_tp, copy_offset)
        await self._done(consumer, tp, offset)

    async def _run_held(
        self, runner: RequestRunner, request: QueuedRequest, batch_size: int
    ) -> RunOutcome:
        """Run the request; it stays held until answered (or, if handed back, until stored)."""
        try:
            outcome = await self._run_request(runner, request, batch_size)
        except BaseException:
            self.intake.finished(request)
            raise
        if outcome != "handed_back":
            self.intake.finished(request)
        return outcome

    async def _run_request(
        self, runner: RequestRunner, request: QueuedRequest, batch_size: int
    ) -> RunOutcome:
        if self._early_cancels.take(request.request_id, time.monotonic()):
            # Its cancel overtook the batch: answer it without running it.
            cancelled = ErrorResult(
                request_id=request.request_id,
                attempt=request.attempt,
                seq=0,
                code=ErrorCode.cancelled,
                message="request cancelled",
            )
            await (await send_result(self._producer, request.reply_to, cancelled))
            return "answered"
        # The engine (vLLM) gets the request span's context, so its spans join the trace.
        return await runner.run(request, batch_size, trace_headers=carrier())

    async def _done(self, consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> None:
        await self.intake.done(consumer, offset)

    async def _obey_cancels(self, consumer: AIOKafkaConsumer) -> None:
        async for record in consumer:
            arrived_at, arrived_wall = time.perf_counter(), time.time()
            try:
                control = _control_records.validate_json(record.value or b"")
            except ValidationError as exc:
                log.error("control.invalid", offset=record.offset, error=str(exc))
                continue
            if not isinstance(control, CancelRecord):
                continue  # edge-to-edge news (a resumed stream): nothing for a worker
            cancel = control
            applied = await apply_cancel(self.engine, cancel, arrived_at, arrived_wall)
            if not applied.found:
                self._early_cancels.remember(cancel.request_id, time.monotonic())
            log.info(
                "cancel.applied",
                request_id=applied.request_id,
                found=applied.found,
                free_slots_before=applied.free_slots_before,
                free_slots_after=applied.free_slots_after,
                total_slots=applied.total_slots,
                arrival_to_free_ms=applied.arrival_to_free_ms,
                record_age_ms=applied.record_age_ms,
            )

    async def _heartbeat(self) -> None:
        interval = self.settings.worker_heartbeat_ms / 1000.0
        while True:
            self.intake.freed.clear()
            await self._send_heartbeat()
            await asyncio.sleep(HEARTBEAT_MIN_GAP_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval - HEARTBEAT_MIN_GAP_S):
                    await self.intake.freed.wait()

    async def _replace_broken_producer(self) -> None:
        """A heartbeat Kafka did not store: start a new producer for everything.

        aiokafka's idempotent producer never writes a partition again once one of its
        batches expired (a broker stopped longer than the request timeout): every later
        batch gets OutOfOrderSequenceNumber, so heartbeats and results would be lost for
        good. Only a new producer (a new producer id) recovers.
        """
        s = self.settings
        while True:
            await self._producer_failed.wait()
            new = make_producer(s, client_id=f"worker-{s.worker_id}")
            try:
                await asyncio.wait_for(new.start(), 10.0)
            except (KafkaError, TimeoutError) as exc:
                log.warning("producer.replace_failed", error=repr(exc))
                with contextlib.suppress(KafkaError, TimeoutError):
                    await asyncio.wait_for(new.stop(), 5.0)
                await asyncio.sleep(1.0)
                continue
            old, self._producer = self._producer, new
            self._runner.use(new)
            self._producer_failed.clear()
            log.info("producer.replaced", worker_id=s.worker_id)
            try:
                await asyncio.wait_for(old.stop(), 5.0)
            except (KafkaError, TimeoutError) as exc:
                log.warning("producer.stop_failed", error=repr(exc))

    def _beat_stored(self, delivery: asyncio.Future[object]) -> None:
        if not delivery.cancelled() and isinstance(delivery.exception(), KafkaError):
            log.warning("heartbeat.not_stored", error=repr(delivery.exception()))
            self._producer_failed.set()

    async def _send_heartbeat(self) -> None:
        cap = self.engine.capacity()
        observe_capacity(cap.running, cap.total_slots)
        intake = self.intake
        # Requests taken in but not yet in the engine count as busy too.
        free = min(cap.free_slots, max(0, cap.total_slots - len(intake)))
        beat = Heartbeat(
            worker_id=self.settings.worker_id,
            model=self.settings.worker_model,
            total_slots=cap.total_slots,
            # A draining worker takes nothing new.
            free_slots=0 if self.drain.requested.is_set() else free,
            running=cap.running,
            queued_tokens=cap.queued_tokens,
            utilisation=min(1.0, cap.utilisation),
            batch_partition=intake.tp.partition,
            batches_consumed=intake.consumed,
            held=intake.held(),
            interval_ms=self.settings.worker_heartbeat_ms,
            started_at=intake.started_at,
        )
        with contextlib.suppress(asyncio.TimeoutError):
            delivery = await self._producer.send(
                self.topics.workers, encode(beat), key=self.settings.worker_id.encode()
            )
            delivery.add_done_callback(self._beat_stored)
