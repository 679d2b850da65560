"""The worker's batch loop: take batch records, run their requests, complete each record.

In static mode (TOKENBUS_WORKER_BATCH_MODE=static) a batch record's requests go to the
engine as one call (`StaticEngine.generate_batch`): they start together and stream as
usual, each answered when its own row ends; in continuous mode each goes on its own.

Nothing it reads can stop it: a batch record it cannot handle is dead-lettered (its
requests answered where they can be), and Kafka errors are retried with backoff. Nothing
it runs ends silently: each request gets one final record, or goes back to the
schedulers as the next attempt. A batch record is committed once every request of it is
answered or handed back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from services.worker.answers import Answers
from services.worker.cancel import CancelBook
from services.worker.drain import hand_back
from services.worker.engines.base import EngineOutput, StaticEngine
from services.worker.intake import BatchIntake, ParsedBatch
from services.worker.liveness import Liveness
from services.worker.runner import RequestRunner, RunOutcome, engine_request
from services.worker.telemetry import RunTrace, WorkerTelemetry
from shared.dead_letters import Source
from shared.fetches import reads
from shared.messages import Batch, ErrorCode, ErrorResult, QueuedRequest
from shared.producers import RenewingProducer
from shared.topics import Topics

log = structlog.get_logger()

FINISHED_BATCHES_KEPT = 10_000  # batch ids run to the end, so a duplicate record is skipped


class BatchLoop:
    """Caller: the worker (`run` as a task; `tasks` for the drain to wait on).

    Affects: the intake (held requests, commits), the runner (a run per request).
    """

    def __init__(
        self,
        intake: BatchIntake,
        runner: RequestRunner,
        liveness: Liveness,
        answers: Answers,
        early_cancels: CancelBook,
        producer: RenewingProducer,
        topics: Topics,
        telemetry: WorkerTelemetry,
        static: StaticEngine | None = None,
    ) -> None:
        self._static = static  # set: each batch record runs as one engine call
        self._intake = intake
        self._runner = runner
        self._liveness = liveness
        self._answers = answers
        self._early_cancels = early_cancels
        self._producer = producer
        self._topics = topics
        self._telemetry = telemetry
        self.tasks: set[asyncio.Task[None]] = set()
        # batch_id -> offsets of copies delivered again while it runs here (a rebalance
        # rewinds to the last commit, which is behind batches still in flight).
        self._redelivered: dict[str, list[tuple[TopicPartition, int]]] = {}
        # batch ids run to the end: a copy written twice by a retried produce is skipped.
        self._finished_batches: OrderedDict[str, None] = OrderedDict()

    async def run(self, consumer: AIOKafkaConsumer, tg: asyncio.TaskGroup) -> None:
        async for taken in reads(lambda: self._intake.take(consumer), what="batches"):
            for record, parsed in taken:
                await self._take(consumer, record, parsed, tg)

    async def _take(
        self,
        consumer: AIOKafkaConsumer,
        record: ConsumerRecord[bytes, bytes],
        parsed: ParsedBatch,
        tg: asyncio.TaskGroup,
    ) -> None:
        tp = self._intake.tp
        if parsed.problem is not None:
            await self._reject(record, parsed)
        batch = parsed.batch
        if batch is None:
            await self._intake.done(consumer, record.offset)
            return
        self._telemetry.batch_received(batch, record, consumer, tp)
        if batch.batch_id in self._finished_batches:
            # A second copy of a batch run to the end (a retried produce).
            log.info("batch.duplicate", batch_id=batch.batch_id, offset=record.offset)
            for request in batch.requests:
                self._intake.finished(request)
            await self._intake.done(consumer, record.offset)
            return
        if batch.batch_id in self._redelivered:
            # Running it twice would stream the same attempt twice, chunked differently:
            # finish the copy with the run already under way.
            log.info("batch.redelivered", batch_id=batch.batch_id, offset=record.offset)
            self._redelivered[batch.batch_id].append((tp, record.offset))
            return
        self._redelivered[batch.batch_id] = []
        runs = None if self._liveness.stale(batch) else self._start(batch, record.offset)
        task = tg.create_task(self._run_batch(consumer, batch, record.offset, runs))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if runs is not None:
            # Cancelled before it could await them (the worker stopping): they stop too.
            task.add_done_callback(lambda t: runs.cancel() if t.cancelled() else None)

    def _start(self, batch: Batch, offset: int) -> asyncio.Future[list[RunOutcome | BaseException]]:
        """Start a run per request now: each begins at the loop's next turn, not a turn
        later from inside the batch's own task (ADR 0042)."""
        log.info("batch.started", batch_id=batch.batch_id, size=len(batch.requests))
        epoch = self._liveness.epoch_now()
        source = Source(self._intake.tp.topic, self._intake.tp.partition, offset)
        streams = self._one_call(batch)
        return asyncio.gather(
            *(
                self._run_held(r, batch, epoch, source, stream)
                for r, stream in zip(batch.requests, streams, strict=True)
            ),
            return_exceptions=True,
        )

    async def _reject(self, record: ConsumerRecord[bytes, bytes], parsed: ParsedBatch) -> None:
        """Dead-letter a batch record that is not a valid batch; answer what can be answered."""
        log.error("batch.invalid", offset=record.offset, error=parsed.problem)
        await self._answers.dead_letter(record, f"invalid batch: {parsed.problem}")
        for rejected in parsed.rejected:
            if rejected.address is None:
                continue
            error = ErrorResult.for_request(
                rejected.address,
                ErrorCode.invalid_request,
                f"invalid request in batch: {rejected.reason}",
            )
            await self._answers.error(rejected.address.reply_to, error)

    async def _run_batch(
        self,
        consumer: AIOKafkaConsumer,
        batch: Batch,
        offset: int,
        runs: asyncio.Future[list[RunOutcome | BaseException]] | None,
    ) -> None:
        """Complete a batch record once each of its runs (None: it is stale) has ended."""
        results: list[RunOutcome | BaseException]
        if runs is None:
            # Sent before a scheduler may have declared us dead: it may run it elsewhere.
            # Handed back, not run; a scheduler drops the copy its own recovery made.
            log.info("batch.stale", batch_id=batch.batch_id, size=len(batch.requests))
            results = ["handed_back"] * len(batch.requests)
        else:
            results = await runs
        if "engine_dead" in results:
            # The worker exits (engine_health.py): the batch stays open, and its requests run
            # elsewhere as after a kill -9 (the schedulers' recovery, or this worker's own
            # takeover once restarted), each once.
            log.warning("batch.left_to_recovery", batch_id=batch.batch_id)
            return
        for request, result in zip(batch.requests, results, strict=True):
            if isinstance(result, BaseException):
                # A bug, not the engine (the runner answers engine failures itself).
                log.error("request.failed", request_id=request.request_id, error=repr(result))
                error = ErrorResult.for_request(
                    request, ErrorCode.internal, "the worker failed this request"
                )
                await self._answers.error(request.reply_to, error)
            elif result in ("handed_back", "rerun"):
                sent = self._runner.left_text(request)
                await hand_back(self._producer, self._topics, request, sent)
                self._intake.finished(request)
        self._finished_batches[batch.batch_id] = None
        while len(self._finished_batches) > FINISHED_BATCHES_KEPT:
            self._finished_batches.popitem(last=False)
        for _, copy_offset in self._redelivered.pop(batch.batch_id, []):
            await self._intake.done(consumer, copy_offset)
        await self._intake.done(consumer, offset)

    def _one_call(self, batch: Batch) -> list[AsyncIterator[EngineOutput] | None]:
        """Static mode: the batch's rows, submitted to the engine now as one call."""
        if self._static is None:
            return [None] * len(batch.requests)
        requests = [engine_request(r) for r in batch.requests]
        log.info("batch.one_call", batch_id=batch.batch_id, rows=len(requests))
        return list(self._static.generate_batch(requests))

    async def _run_held(
        self,
        request: QueuedRequest,
        batch: Batch,
        epoch: int,
        source: Source,
        stream: AsyncIterator[EngineOutput] | None = None,
    ) -> RunOutcome:
        """Run the request; it stays held until answered (or, if handed back, until stored).

        `stream`: its row of a batch run as one call (static mode), closed when the run
        ends; a run that never reads it (an early cancel, a dead reply topic) also aborts
        the row (`_drop_row`). No trace context reaches the engine for such rows: the
        batch is submitted before any of its runs has a span.
        """
        try:
            async with contextlib.AsyncExitStack() as closing:
                if stream is not None:
                    closing.push_async_callback(_close, stream)
                with self._telemetry.run(request, batch) as trace:
                    outcome = await self._run_request(request, batch, trace, epoch, source, stream)
                    self._telemetry.run_ended(trace, request, outcome)
        except BaseException:
            self._intake.finished(request)
            raise
        if outcome in ("answered", "superseded", "escalated"):
            self._intake.finished(request)
        return outcome

    async def _drop_row(
        self, request: QueuedRequest, stream: AsyncIterator[EngineOutput] | None
    ) -> None:
        """Static mode: take a row that will not run out of its batch (closing a stream
        never read does not reach the engine; an abort does)."""
        if stream is not None and self._static is not None:
            await self._static.abort(request.request_id)

    async def _run_request(
        self,
        request: QueuedRequest,
        batch: Batch,
        trace: RunTrace,
        epoch: int,
        source: Source,
        stream: AsyncIterator[EngineOutput] | None,
    ) -> RunOutcome:
        if self._early_cancels.take(request.request_id, time.monotonic()):
            # Its cancel overtook the batch: answer it without running it.
            await self._drop_row(request, stream)
            cancelled = ErrorResult.for_request(request, ErrorCode.cancelled, "request cancelled")
            await self._answers.error(request.reply_to, cancelled)
            return "answered"
        problem = await self._answers.reply_problem(request.reply_to)
        if problem is not None:
            # Nobody can be told anything: running it would only fail at its first write.
            await self._drop_row(request, stream)
            await self._answers.undeliverable(request, source, problem)
            return "answered"
        return await self._runner.run(
            request,
            len(batch.requests),
            trace,
            formed_at=batch.formed_at,
            epoch=epoch,
            stream=stream,
        )


async def _close(stream: AsyncIterator[EngineOutput]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
