"""The scheduler's error answers and dead letters: written in bounded time, never lost.

An answer that cannot be stored in time (or ever: its `reply_to` cannot be written) is
dead-lettered with its request instead: never a silent commit, never a stall.
"""

from __future__ import annotations

import structlog
from aiokafka.structs import ConsumerRecord, RecordMetadata

from services.scheduler.admission import Poison, Waiting
from services.scheduler.settings import SchedulerSettings
from shared.dead_letters import (
    INVALID_RECORD,
    UNDELIVERABLE,
    ReplyStatus,
    Source,
    dead_letter,
    letter,
)
from shared.kafka import encode, key_of
from shared.messages import ErrorCode, ErrorResult, ReplyTo
from shared.producers import RenewingProducer
from shared.results import WRITE_ERRORS, ReplyTargets, send_result
from shared.retry import retrying
from shared.topics import Topics

log = structlog.get_logger()

METADATA_TIMEOUT_S = 2.0  # longest a reply_to look-up may take


class Answerer:
    """Writes error results to `reply_to` and records to the DLQ. Caller: the scheduler."""

    def __init__(
        self, settings: SchedulerSettings, topics: Topics, producer: RenewingProducer
    ) -> None:
        self._settings = settings
        self._topics = topics
        self._producer = producer
        self._targets = ReplyTargets(producer, timeout_s=METADATA_TIMEOUT_S)
        self._reader = f"scheduler:{settings.scheduler_id}"

    async def dead_letter(
        self,
        record: ConsumerRecord[bytes, bytes],
        reason: str,
        reply: ReplyStatus = ReplyStatus.none,
        reply_error: str | None = None,
    ) -> None:
        """Dead-letter a record this process cannot read (`invalid_request`), bounded in time."""
        await dead_letter(
            self._producer,
            self._topics.dlq,
            letter(
                record.value or b"",
                key=record.key,
                source=Source.of(record),
                reason=INVALID_RECORD,
                code=ErrorCode.invalid_request.value,
                error=reason,
                reader=self._reader,
                reply=reply,
                reply_error=reply_error,
            ),
            within_s=self._settings.scheduler_answer_timeout_s,
        )

    async def reject(self, poison: Poison) -> None:
        """Answer a tier record that is not a request if it can be, then dead-letter it."""
        address = poison.address
        reply, problem = ReplyStatus.none, None
        if address is not None:
            error = ErrorResult.for_request(
                address, ErrorCode.invalid_request, f"invalid request: {poison.reason}"
            )
            problem = await self._write(address.reply_to, error, None)
            reply = ReplyStatus.undeliverable if problem else ReplyStatus.delivered
        await self.dead_letter(
            poison.record, f"invalid tier record: {poison.reason}", reply, problem
        )

    async def answer(self, waiting: Waiting, error: ErrorResult) -> None:
        """Publish the error to the request's result stream (or dead-letter the request)."""
        await self._write(waiting.request.reply_to, error, waiting)

    async def _write(self, reply_to: ReplyTo, error: ErrorResult, w: Waiting | None) -> str | None:
        """Write `error`, bounded; None once stored, else why not (with `w`, its request is
        then dead-lettered)."""
        within = self._settings.scheduler_answer_timeout_s
        try:
            problem = await self._targets.problem(reply_to)
        except WRITE_ERRORS as exc:
            problem = None  # the cluster cannot say now: try the write, bounded
            log.warning("reply_to.lookup_failed", topic=reply_to.topic, error=repr(exc))
        if problem is None:

            async def write() -> RecordMetadata:
                return await (await send_result(self._producer, reply_to, error))

            try:
                await retrying(
                    write,
                    within_s=within,
                    what="answer",
                    retry_on=WRITE_ERRORS,
                    request_id=error.request_id,
                )
                log.info("request.answered", request_id=error.request_id, code=error.code.value)
                return None
            except WRITE_ERRORS as exc:
                problem = f"the answer was not stored within {within} s: {exc!r}"
        log.error("answer.undeliverable", request_id=error.request_id, reason=problem)
        if w is not None:
            await dead_letter(
                self._producer,
                self._topics.dlq,
                letter(
                    encode(w.request),
                    key=key_of(w.request.request_id),
                    source=Source(w.tp.topic, w.tp.partition, w.offset),
                    reason=UNDELIVERABLE,
                    code=error.code.value,
                    error=f"{error.message}; undeliverable: {problem}",
                    reader=self._reader,
                    reply=ReplyStatus.undeliverable,
                    request_id=w.request.request_id,
                    reply_error=problem,
                ),
                within_s=within,
            )
        return problem
