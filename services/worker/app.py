"""The worker process: takes batches, runs them on the engine, obeys cancels, heartbeats.

Nothing it reads can stop it: a batch or control record it cannot handle is dead-lettered
(its requests answered where they can be), and Kafka errors are retried with backoff.
Nothing it runs ends silently: each request gets one final record, or goes back to the
schedulers as the next attempt (`runner.py`). A worker whose heartbeats stopped reaching
Kafka long enough to be declared dead fences itself (`fence.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import OrderedDict

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, RecordMetadata
from pydantic import TypeAdapter, ValidationError

from services.worker.cancel import CancelBook, apply_cancel
from services.worker.drain import Drain, hand_back
from services.worker.engines.base import Engine
from services.worker.fence import Fence
from services.worker.intake import BatchIntake, ParsedBatch
from services.worker.runner import RequestRunner, RunOutcome
from services.worker.settings import WorkerSettings
from services.worker.telemetry import batch_received, observe_capacity, run_traced
from shared.dead_letters import Source, dead_letter, dead_letter_value
from shared.health import Readiness, consumer_readiness
from shared.kafka import encode, make_consumer, make_producer
from shared.messages import (
    Batch,
    CancelRecord,
    ControlRecord,
    ErrorCode,
    ErrorResult,
    Heartbeat,
    QueuedRequest,
    ReplyTo,
    error_message,
)
from shared.producers import RenewingProducer
from shared.results import WRITE_ERRORS, ReplyTargets, send_result
from shared.retry import backoffs, retrying
from shared.telemetry import carrier
from shared.topics import Topics

log = structlog.get_logger()

_control_records: TypeAdapter[ControlRecord] = TypeAdapter(ControlRecord)

# After a slot frees, the next heartbeat goes out this soon (not sooner), so schedulers
# refill the slot without waiting for the regular interval.
HEARTBEAT_MIN_GAP_S = 0.05
FINISHED_BATCHES_KEPT = 10_000  # batch ids run to the end, so a duplicate record is skipped
METADATA_TIMEOUT_S = 2.0  # longest a reply_to look-up may take (the broker is answering)


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
        # batch ids run to the end: a copy written twice by a retried produce is skipped.
        self._finished_batches: OrderedDict[str, None] = OrderedDict()
        self._early_cancels = CancelBook()
        interval = settings.worker_heartbeat_ms / 1000.0
        self.fence = Fence(settings.fence_after_beats * interval, time.monotonic())
        self._epoch = 0
        # Wall time before which batches sent here may have been handed back by a scheduler
        # that declared us dead: such batches go back too, they are not run here.
        self._stale_before = 0.0
        self._fencing: set[asyncio.Task[None]] = set()
        self._reader = f"worker:{settings.worker_id}"

    async def run(self) -> None:
        s = self.settings
        # Renewed if an outage breaks its sequence numbers (shared/producers.py).
        producer = RenewingProducer(lambda: make_producer(s, client_id=f"worker-{s.worker_id}"))
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
                epoch_now=self._epoch_now,
                write_timeout_s=s.worker_result_write_timeout_s,
            )
            self._producer = producer
            self._targets = ReplyTargets(producer, timeout_s=METADATA_TIMEOUT_S)
            self._runner = runner
            if self._drain_on_sigterm:
                # SIGTERM drains (SIGINT still cancels at once, via run_service).
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.drain.signal)
            log.info(
                "worker.started",
                worker_id=s.worker_id,
                engine=self.engine.name,
                context_length=self.engine.context_length,
            )
            self.fence.stored(time.monotonic())  # starting up is no silence
            async with asyncio.TaskGroup() as tg:
                taker = tg.create_task(self._take_batches(batches, runner, tg))
                others = [
                    tg.create_task(self._obey_cancels(control)),
                    tg.create_task(self._heartbeat(producer)),
                ]
                await self.drain.requested.wait()
                taker.cancel()
                await self._send_heartbeat(producer)  # tell schedulers: no free slots here
                await self.drain.run(self._batch_tasks, lambda: runner.running, runner.hand_back)
                for task in others:
                    task.cancel()
            log.info("worker.drained", worker_id=s.worker_id)
        finally:
            await self.engine.stop()
            await batches.stop()
            await control.stop()
            await producer.stop()

    async def readiness(self) -> Readiness:
        """`/readyz` (shared/health.py): batch partition assigned, broker answering."""
        if self.drain.requested.is_set():
            return Readiness.not_ready("draining")
        return await consumer_readiness([self.intake.reading])

    # -- fencing -----------------------------------------------------------------------------

    def _epoch_now(self) -> int:
        """The fence epoch; fences the worker first if its heartbeats went unstored too long."""
        now = time.monotonic()
        silent = self.fence.silent_for(now)
        epoch = self.fence.check(now)
        if epoch != self._epoch:
            self._epoch = epoch
            self._fenced(silent)
        return epoch

    def _fenced(self, silent_s: float) -> None:
        """Schedulers may have declared us dead and re-run our requests: stop all of ours."""
        running = sorted(self._runner.running) if hasattr(self, "_runner") else []
        if not running and len(self.intake) == 0:
            # Nothing of ours can be re-run elsewhere (a broker outage, a slow start): the
            # same incarnation goes on. A batch sent meanwhile runs when read: if it was
            # handed back too, the reset written first hides this run from every reader.
            log.info("worker.silent", worker_id=self.settings.worker_id, silent_s=silent_s)
            return
        # Schedulers could declare us dead `dead_after_s` into the silence, and send us
        # nothing after that until we beat again: what they sent before goes back too.
        silent_since = time.time() - silent_s
        self._stale_before = max(self._stale_before, silent_since + self.fence.dead_after_s)
        log.warning(
            "worker.fenced",
            worker_id=self.settings.worker_id,
            silent_s=round(silent_s, 3),
            epoch=self._epoch,
            running=len(running),
        )
        self.intake.renew()  # heartbeats from now on are a new incarnation's
        if running:
            task = asyncio.get_running_loop().create_task(self._stop_runs(running))
            self._fencing.add(task)
            task.add_done_callback(self._fencing.discard)

    async def _stop_runs(self, request_ids: list[str]) -> None:
        # Each run then returns "handed_back" without writing, and its batch hands it back.
        for request_id in request_ids:
            await self._runner.hand_back(request_id)

    # -- batches -----------------------------------------------------------------------------

    async def _take_batches(
        self, consumer: AIOKafkaConsumer, runner: RequestRunner, tg: asyncio.TaskGroup
    ) -> None:
        tp = self.intake.tp
        next_wait = backoffs()
        while True:
            try:
                taken = await self.intake.take(consumer)
            except KafkaError as exc:
                wait = next_wait()
                log.warning("batches.fetch_failed", error=repr(exc), retry_in_s=wait)
                await asyncio.sleep(wait)
                continue
            next_wait = backoffs()
            for record, parsed in taken:
                if parsed.problem is not None:
                    await self._reject(record, parsed)
                batch = parsed.batch
                if batch is None:
                    await self._done(consumer, tp, record.offset)
                    continue
                batch_received(batch, record, consumer, tp)
                if batch.batch_id in self._finished_batches:
                    # A second copy of a batch run to the end (a retried produce).
                    log.info("batch.duplicate", batch_id=batch.batch_id, offset=record.offset)
                    for request in batch.requests:
                        self.intake.finished(request)
                    await self._done(consumer, tp, record.offset)
                    continue
                if batch.batch_id in self._redelivered:
                    # Running it twice would stream the same attempt twice, chunked
                    # differently: finish the copy with the run already under way.
                    log.info("batch.redelivered", batch_id=batch.batch_id, offset=record.offset)
                    self._redelivered[batch.batch_id].append((tp, record.offset))
                    continue
                self._redelivered[batch.batch_id] = []
                epoch = self._epoch_now()
                stale = batch.formed_at < self._stale_before
                task = tg.create_task(
                    self._run_batch(consumer, runner, batch, tp, record.offset, epoch, stale)
                )
                self._batch_tasks.add(task)
                task.add_done_callback(self._batch_tasks.discard)

    async def _dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        """Dead-letter a record this process cannot read (`invalid_request`), bounded in time."""
        await dead_letter(
            self._producer,
            self.topics.dlq,
            record,
            code=ErrorCode.invalid_request.value,
            reason=reason,
            reader=self._reader,
            within_s=self.settings.worker_result_write_timeout_s,
        )

    async def _reject(self, record: ConsumerRecord[bytes, bytes], parsed: ParsedBatch) -> None:
        """Dead-letter a batch record that is not a valid batch; answer what can be answered."""
        log.error("batch.invalid", offset=record.offset, error=parsed.problem)
        await self._dead_letter(record, f"invalid batch: {parsed.problem}")
        for rejected in parsed.rejected:
            if rejected.address is None:
                continue
            error = ErrorResult(
                request_id=rejected.address.request_id,
                attempt=rejected.address.attempt,
                seq=0,
                code=ErrorCode.invalid_request,
                message=f"invalid request in batch: {rejected.reason}",
            )
            await self._answer(rejected.address.reply_to, error)

    async def _run_batch(
        self,
        consumer: AIOKafkaConsumer,
        runner: RequestRunner,
        batch: Batch,
        tp: TopicPartition,
        offset: int,
        epoch: int,
        stale: bool,
    ) -> None:
        log.info("batch.started", batch_id=batch.batch_id, size=len(batch.requests), stale=stale)
        if stale:
            # Sent before a scheduler may have declared us dead: it may run it elsewhere.
            # Handed back, not run; a scheduler drops the copy its own recovery made.
            results: list[RunOutcome | BaseException] = ["handed_back"] * len(batch.requests)
        else:
            source = Source(tp.topic, tp.partition, offset)
            size = len(batch.requests)
            results = await asyncio.gather(
                *(
                    run_traced(r, batch, self._run_held(runner, r, size, epoch, source))
                    for r in batch.requests
                ),
                return_exceptions=True,
            )
        for request, result in zip(batch.requests, results, strict=True):
            if isinstance(result, BaseException):
                # A bug, not the engine (the runner answers engine failures itself).
                log.error("request.failed", request_id=request.request_id, error=repr(result))
                await self._answer(
                    request.reply_to,
                    ErrorResult(
                        request_id=request.request_id,
                        attempt=request.attempt,
                        seq=0,
                        code=ErrorCode.internal,
                        message="the worker failed this request",
                    ),
                )
            elif result in ("handed_back", "rerun"):
                await hand_back(self._producer, self.topics, request)
                self.intake.finished(request)
        self._finished_batches[batch.batch_id] = None
        while len(self._finished_batches) > FINISHED_BATCHES_KEPT:
            self._finished_batches.popitem(last=False)
        for copy_tp, copy_offset in self._redelivered.pop(batch.batch_id, []):
            await self._done(consumer, copy_tp, copy_offset)
        await self._done(consumer, tp, offset)

    async def _run_held(
        self,
        runner: RequestRunner,
        request: QueuedRequest,
        batch_size: int,
        epoch: int,
        source: Source,
    ) -> RunOutcome:
        """Run the request; it stays held until answered (or, if handed back, until stored)."""
        try:
            outcome = await self._run_request(runner, request, batch_size, epoch, source)
        except BaseException:
            self.intake.finished(request)
            raise
        if outcome in ("answered", "superseded"):
            self.intake.finished(request)
        return outcome

    async def _run_request(
        self,
        runner: RequestRunner,
        request: QueuedRequest,
        batch_size: int,
        epoch: int,
        source: Source,
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
            await self._answer(request.reply_to, cancelled)
            return "answered"
        problem = await self._reply_problem(request.reply_to)
        if problem is not None:
            # Nobody can be told anything: running it would only fail at its first write.
            log.error("request.undeliverable", request_id=request.request_id, reason=problem)
            await dead_letter_value(
                self._producer,
                self.topics.dlq,
                encode(request),
                key=request.request_id.encode(),
                source=source,
                code=ErrorCode.invalid_request.value,
                reason=f"undeliverable: {problem}",
                reader=self._reader,
                within_s=self.settings.worker_result_write_timeout_s,
            )
            return "answered"
        # The engine (vLLM) gets the request span's context, so its spans join the trace.
        return await runner.run(request, batch_size, trace_headers=carrier(), epoch=epoch)

    async def _reply_problem(self, reply_to: ReplyTo) -> str | None:
        """Why `reply_to` cannot be written; None if it can (or the cluster cannot say now)."""
        try:
            return await self._targets.problem(reply_to)
        except WRITE_ERRORS as exc:
            log.warning("reply_to.lookup_failed", topic=reply_to.topic, error=repr(exc))
            return None

    async def _answer(self, reply_to: ReplyTo, error: ErrorResult) -> bool:
        """Write one error record, bounded; False (logged) if it cannot be stored."""
        problem = await self._reply_problem(reply_to)
        if problem is not None:
            log.error("answer.undeliverable", request_id=error.request_id, reason=problem)
            return False

        async def write() -> RecordMetadata:
            return await (await send_result(self._producer, reply_to, error))

        try:
            await retrying(
                write,
                within_s=self.settings.worker_result_write_timeout_s,
                what="answer",
                retry_on=WRITE_ERRORS,
                request_id=error.request_id,
            )
        except WRITE_ERRORS as exc:
            log.error("answer.failed", request_id=error.request_id, error=repr(exc))
            return False
        log.info("request.answered", request_id=error.request_id, code=error.code.value)
        return True

    async def _done(self, consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> None:
        await self.intake.done(consumer, offset)

    # -- control -----------------------------------------------------------------------------

    async def _obey_cancels(self, consumer: AIOKafkaConsumer) -> None:
        next_wait = backoffs()
        while True:
            try:
                record = await consumer.getone()
            except KafkaError as exc:
                wait = next_wait()
                log.warning("control.fetch_failed", error=repr(exc), retry_in_s=wait)
                await asyncio.sleep(wait)
                continue
            next_wait = backoffs()
            await self._obey(record)

    async def _obey(self, record: ConsumerRecord[bytes, bytes]) -> None:
        arrived_at, arrived_wall = time.perf_counter(), time.time()
        try:
            control = _control_records.validate_json(record.value or b"")
        except ValidationError as exc:
            log.error("control.invalid", offset=record.offset, error=str(exc)[:500])
            await self._dead_letter(record, f"invalid control record: {error_message(exc)}")
            return
        if not isinstance(control, CancelRecord):
            return  # edge-to-edge news (a resumed stream): nothing for a worker
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

    # -- heartbeats --------------------------------------------------------------------------

    async def _heartbeat(self, producer: AIOKafkaProducer) -> None:
        interval = self.settings.worker_heartbeat_ms / 1000.0
        while True:
            self.intake.freed.clear()
            await self._send_heartbeat(producer)
            await asyncio.sleep(HEARTBEAT_MIN_GAP_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval - HEARTBEAT_MIN_GAP_S):
                    await self.intake.freed.wait()

    async def _send_heartbeat(self, producer: AIOKafkaProducer) -> None:
        self._epoch_now()  # after a pause, fence before telling anyone we are alive
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
        sent_at = time.monotonic()
        try:
            future = await producer.send(
                self.topics.workers, encode(beat), key=self.settings.worker_id.encode()
            )
        except WRITE_ERRORS as exc:
            log.warning("heartbeat.send_failed", error=repr(exc))
            return

        def stored(f: asyncio.Future[RecordMetadata]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.fence.stored(sent_at)

        future.add_done_callback(stored)
