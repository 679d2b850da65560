"""What the worker writes besides a run's stream: one-off error answers and dead letters.

Each write is bounded in time (`worker_result_write_timeout_s`) and never stops the
worker: a record that cannot be stored is logged with its context and skipped.
"""

from __future__ import annotations

import structlog
from aiokafka.structs import ConsumerRecord, RecordMetadata

from services.worker.settings import WorkerSettings
from shared.dead_letters import (
    INVALID_RECORD,
    UNDELIVERABLE,
    ReplyStatus,
    Source,
    dead_letter,
    letter,
)
from shared.kafka import encode
from shared.messages import ErrorCode, ErrorResult, QueuedRequest, ReplyTo
from shared.producers import RenewingProducer
from shared.results import WRITE_ERRORS, ReplyTargets, send_result
from shared.retry import retrying
from shared.topics import Topics

log = structlog.get_logger()

METADATA_TIMEOUT_S = 2.0  # longest a reply_to look-up may take (the broker is answering)


class Answers:
    """Caller: the batch loop and the cancel listener. Owns nothing but a `ReplyTargets`."""

    def __init__(self, producer: RenewingProducer, settings: WorkerSettings) -> None:
        self._producer = producer
        self._dlq = Topics(settings.topic_prefix).dlq
        self._within_s = settings.worker_result_write_timeout_s
        self._reader = f"worker:{settings.worker_id}"
        self._targets = ReplyTargets(producer, timeout_s=METADATA_TIMEOUT_S)

    async def dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        """Dead-letter a record this process cannot read (`invalid_request`), bounded in time.

        Its `tokenbus-reply` is `none`: a batch's requests are answered one by one.
        """
        await dead_letter(
            self._producer,
            self._dlq,
            letter(
                record.value or b"",
                key=record.key,
                source=Source.of(record),
                reason=INVALID_RECORD,
                code=ErrorCode.invalid_request.value,
                error=reason,
                reader=self._reader,
                reply=ReplyStatus.none,
            ),
            within_s=self._within_s,
        )

    async def undeliverable(self, request: QueuedRequest, source: Source, problem: str) -> None:
        """Dead-letter a request nobody can be told anything about (its `reply_to` is bad)."""
        log.error("request.undeliverable", request_id=request.request_id, reason=problem)
        await dead_letter(
            self._producer,
            self._dlq,
            letter(
                encode(request),
                key=request.request_id.encode(),
                source=source,
                reason=UNDELIVERABLE,
                code=ErrorCode.invalid_request.value,
                error=f"undeliverable: {problem}",
                reader=self._reader,
                reply=ReplyStatus.undeliverable,
                request_id=request.request_id,
                reply_error=problem,
            ),
            within_s=self._within_s,
        )

    async def reply_problem(self, reply_to: ReplyTo) -> str | None:
        """Why `reply_to` cannot be written; None if it can (or the cluster cannot say now)."""
        try:
            return await self._targets.problem(reply_to)
        except WRITE_ERRORS as exc:
            log.warning("reply_to.lookup_failed", topic=reply_to.topic, error=repr(exc))
            return None

    async def error(self, reply_to: ReplyTo, error: ErrorResult) -> bool:
        """Write one error record, bounded; False (logged) if it cannot be stored."""
        problem = await self.reply_problem(reply_to)
        if problem is not None:
            log.error("answer.undeliverable", request_id=error.request_id, reason=problem)
            return False

        async def write() -> RecordMetadata:
            return await (await send_result(self._producer, reply_to, error))

        try:
            await retrying(
                write,
                within_s=self._within_s,
                what="answer",
                retry_on=WRITE_ERRORS,
                request_id=error.request_id,
            )
        except WRITE_ERRORS as exc:
            log.error("answer.failed", request_id=error.request_id, error=repr(exc))
            return False
        log.info("request.answered", request_id=error.request_id, code=error.code.value)
        return True
