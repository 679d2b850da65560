"""Ingest's handling of fetched request records: decide each, hand all on, remember them.

Each record ends in exactly one outcome: forwarded to its tier once, answered from the
response cache once (its cached stream written to its `reply_to`, response_cache.py), or
dead-lettered once with an error to its `reply_to` when that can be delivered. A batch's
writes are sent together and awaited together (one produce request, not one per record);
a transient Kafka failure is retried in place with backoff (nothing is skipped), anything
else about a record is a rejection (so nothing is retried forever). Only once every record
of a batch has its outcome does the caller commit the batch's offsets; a crash before that
re-reads them, and the durable memory (memory.py) drops what was already handed on.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeAlias, TypeVar

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
)
from aiokafka.structs import RecordMetadata

from services.ingest.admission import (
    Admitted,
    Decision,
    Duplicate,
    Reason,
    Rejected,
    admit,
    not_forwarded,
    over_quota,
    undeliverable,
    without_reply,
)
from services.ingest.apps import AppQuotas, Apps
from services.ingest.memory import Memory, RecallRefused, recall
from services.ingest.response_cache import ResponseCache, replay
from services.ingest.settings import IngestSettings
from services.ingest.telemetry import IngestTelemetry
from shared.dead_letters import ReplyStatus, Source, dead_letter
from shared.kafka import Headers, encode, key_of
from shared.messages import ErrorCode, ErrorResult, ReplyTo
from shared.producers import RenewingProducer
from shared.results import ReplyTargets, Unwritable
from shared.retry import Backoff
from shared.topics import Topics

log = structlog.get_logger()

# Failures that no retry can cure: the write itself is refused.
PERMANENT = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    InvalidTopicError,
    AssertionError,  # aiokafka's check of an explicit partition against its metadata
)
# Failures that pass: the broker or its metadata did not answer (yet).
TRANSIENT = (KafkaError, TimeoutError, OSError)
T = TypeVar("T")
Record: TypeAlias = ConsumerRecord[bytes, bytes]


@dataclass
class _Sending:
    """An admitted record whose tier write is queued; its outcome is known once stored."""

    record: Record
    decision: Admitted
    headers: Headers
    future: Awaitable[object] | None  # None: the send failed at once, with:
    failure: BaseException | None
    # A cache hit's records (value, headers), encoded once: a retry writes the same bytes.
    replies: list[tuple[bytes, Headers]] | None = None


class Ingest:
    """Decide, check where it may go, hand it on, remember it; one batch at a time.

    Owner of `memory` (what was handed on) and of the writes of `producer`.
    Caller: the request reader (reader.py), one `handle_batch` at a time.
    """

    def __init__(
        self,
        settings: IngestSettings,
        producer: RenewingProducer,
        admin: AIOKafkaAdminClient,
        telemetry: IngestTelemetry,
        cache: ResponseCache | None = None,
        *,
        tails: AIOKafkaConsumer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`tails` is the started group-less consumer that reads the tier topics' and the
        DLQ's tails back at each assignment (memory.py); the caller owns and stops it."""
        self.settings = settings
        self.cache = cache  # None: the response cache is off
        self.topics = Topics(settings.topic_prefix)
        self.apps = Apps(self.topics, settings.apps)
        self.quotas = AppQuotas(
            settings.ingest_app_rps,
            settings.ingest_app_burst,
            settings.ingest_app_bytes_per_s,
            settings.ingest_app_burst_bytes,
        )
        self._clock = clock
        self.limits = settings.limits()
        self.memory = Memory.of_size(settings.ingest_dedupe_window)
        self.producer = producer
        self.admin = admin
        self.tails = tails
        self.telemetry = telemetry
        self._recalled = asyncio.Event()
        # A missing topic is asked about every time (it may be created any moment).
        self.reply_targets = ReplyTargets(
            producer,
            timeout_s=settings.reply_timeout_s,
            grace_s=settings.ingest_reply_to_grace_ms / 1000,
            remember_s=0.0,
        )
        self._backoff_s = (
            settings.ingest_retry_backoff_ms / 1000,
            settings.ingest_retry_backoff_max_ms / 1000,
        )
        # Who wrote its dead letters (`tokenbus-dead-lettered-by`), as a scheduler's id reads.
        self._reader = f"ingest:{socket.gethostname()}-{os.getpid()}"

    async def recall(self) -> None:
        """Refill the memory from the tier topics and the DLQ; retried until it succeeds,
        since forwarding without it could run a request twice.

        aiokafka may hand out records of a new assignment while its listener still runs,
        so `handle_batch` waits for `_recalled` rather than trusting the listener's order.
        """
        self._recalled.clear()
        backoff = Backoff(*self._backoff_s)
        while True:
            try:
                await recall(
                    self.memory,
                    self.topics,
                    self.admin,
                    self.tails,
                    self.settings.ingest_dedupe_window,
                )
                self._recalled.set()
                return
            except RecallRefused as exc:
                # Nothing is forwarded until an operator grants the ACL: say which, loudly.
                delay = backoff.next()
                log.error(
                    "memory.recall_refused",
                    topic=exc.topic,
                    operation=exc.operation,
                    error=str(exc),
                    retry_in_s=delay,
                )
                await asyncio.sleep(delay)
            except Exception as exc:
                delay = backoff.next()
                log.warning("memory.recall_failed", error=_describe(exc), retry_in_s=delay)
                await asyncio.sleep(delay)

    async def handle(self, record: Record) -> Decision | None:
        """Hand one record on; None when it was dead-lettered before (a redelivery)."""
        [decision] = await self.handle_batch([record])
        return decision

    async def handle_batch(self, records: Sequence[Record]) -> list[Decision | None]:
        """Hand every record on; returns once each has its outcome, in the records' order.

        None for a record dead-lettered before (a redelivery).
        """
        await self._recalled.wait()
        outcomes: list[Decision | None] = [None] * len(records)
        sending: list[tuple[int, _Sending]] = []
        in_batch: set[str] = set()  # admitted ids of this batch: a second copy is a duplicate
        # 1) Decide each record and queue its write; rejections are settled one by one.
        for i, record in enumerate(records):
            source = Source(record.topic, record.partition, record.offset)
            if source.position in self.memory.dead_lettered:
                log.info("record.already_dead_lettered", source=str(source))
                continue
            try:
                decision = await self._decide(record, source, in_batch)
                if isinstance(decision, Admitted):
                    in_batch.add(decision.request.request_id)
                    sending.append((i, await self._send(record, decision)))
                outcomes[i] = decision
            except TRANSIENT:
                raise  # only from shutdown: the batch is read again
            except Exception as exc:
                outcomes[i] = await self._failed(record, source, exc)
        # 2) Wait for the tier writes together; a write that failed is retried on its own.
        for i, pending in sending:
            outcomes[i] = await self._stored(pending)
        for outcome in outcomes:
            if outcome is not None:
                self.telemetry.decided(outcome)
        return outcomes

    async def _decide(self, record: Record, source: Source, in_batch: set[str]) -> Decision:
        """Admit the record, or reject it (answered and dead-lettered here)."""
        value = record.value or b""
        app = self.apps.of_topic(record.topic)
        # 1) An application's record is charged, by count and by bytes, before it is parsed:
        # a flood over its quota costs ingest no parse and the DLQ a short copy (N6).
        retry_after_ms = (
            self.quotas.charge(app.name, self._clock(), len(value)) if app is not None else None
        )
        if app is not None and retry_after_ms is not None:
            decision: Decision = over_quota(app, record.key, retry_after_ms)
        else:
            # 2) Decide from the record alone (and, from an app's topic, who wrote it).
            decision = admit(
                value,
                record.key,
                self.topics,
                self.limits,
                _Seen(self.memory, in_batch),
                max_record_bytes=self.settings.ingest_max_record_bytes,
                cache=self.cache is not None,
                app=app,
            )
        if isinstance(decision, Duplicate):
            log.info("request.duplicate", request_id=decision.request_id, source=str(source))
            return decision
        # 3) Nothing is forwarded or answered whose results could not be delivered.
        reply_problem = None
        reply_to = _reply_to(decision)
        if reply_to is not None:
            verdict = await self._retrying(
                f"check reply_to {reply_to.topic}", lambda: self.reply_targets.check(reply_to)
            )
            if verdict is not None:
                reply_problem = verdict.why
                decision = (
                    undeliverable(decision, _REASONS[verdict.kind], verdict.why)
                    if isinstance(decision, Admitted)
                    else without_reply(decision)
                )
        if isinstance(decision, Admitted):
            return self._answered_from_cache(decision)
        # 4) Tell the requester, then dead-letter the record (last: it marks the end).
        await self._reject(decision, record, source, reply_problem)
        return decision

    def _answered_from_cache(self, decision: Admitted) -> Admitted:
        """The decision with its cached answer, on a hit (it then never reaches a tier)."""
        answer = self.cache.get(decision.request) if self.cache is not None else None
        if answer is None:
            return decision
        log.info(
            "request.cache_hit",
            request_id=decision.request.request_id,
            answered_first=answer.request_id,
            chunks=len(answer.chunks),
        )
        return replace(decision, answer=answer)

    async def _send(self, record: Record, decision: Admitted) -> _Sending:
        headers = self.telemetry.tier_headers(record, decision)
        if decision.answer is not None:
            return await self._send_answer(record, decision, headers)
        try:
            future = await self.producer.send(
                decision.topic,
                decision.value,
                key=key_of(decision.request.request_id),
                headers=headers,
            )
        except (*TRANSIENT, *PERMANENT) as exc:
            return _Sending(record, decision, headers, None, exc)
        return _Sending(record, decision, headers, future, None)

    async def _send_answer(self, record: Record, decision: Admitted, headers: Headers) -> _Sending:
        """Queue a cache hit's result stream to its `reply_to`: one future for all of it."""
        replies = self._answer_records(decision, headers)
        futures: list[asyncio.Future[RecordMetadata]] = []
        try:
            for value, extra in replies:
                futures.append(await self._send_reply(decision, value, extra))
        except (*TRANSIENT, *PERMANENT) as exc:
            for future in futures:
                future.add_done_callback(_observed)
            return _Sending(record, decision, headers, None, exc, replies)
        return _Sending(record, decision, headers, asyncio.gather(*futures), None, replies)

    def _answer_records(self, decision: Admitted, headers: Headers) -> list[tuple[bytes, Headers]]:
        """A hit's records, encoded; `done` carries the trace context on, as a worker's does."""
        if decision.answer is None:
            raise AssertionError("not a cache hit")
        records = replay(decision.request, decision.answer, time.time())
        last = len(records) - 1
        return [(encode(r), headers if i == last else []) for i, r in enumerate(records)]

    async def _send_reply(
        self, decision: Admitted, value: bytes, headers: Headers
    ) -> asyncio.Future[RecordMetadata]:
        reply_to = decision.request.reply_to
        return await self.producer.send(
            reply_to.topic,
            value,
            key=key_of(decision.request.request_id),
            partition=reply_to.partition,
            headers=headers,
        )

    async def _write_reply(self, decision: Admitted, value: bytes, headers: Headers) -> None:
        await (await self._send_reply(decision, value, headers))

    async def _stored(self, sending: _Sending) -> Decision:
        """The outcome of an admitted record once its tier write is stored (or refused)."""
        decision = sending.decision
        request = decision.request
        failure = sending.failure
        if sending.future is not None:
            try:
                await sending.future
            except (*TRANSIENT, *PERMANENT) as exc:
                failure = exc
        if failure is not None:
            if isinstance(failure, PERMANENT):
                refused: Rejected | None = self._not_forwarded(decision, failure)
            else:
                log.warning(
                    "kafka.retrying", what=f"publish to {decision.topic}", error=_describe(failure)
                )
                await self.producer.settled()
                refused = await self._forward(sending)
            if refused is not None:
                record = sending.record
                source = Source(record.topic, record.partition, record.offset)
                await self._reject(refused, record, source, None)
                return refused
        # Remembered only now that a tier holds it: a failed write is retried, not dropped.
        self.memory.forwarded.remember(request.request_id)
        log.info("request.admitted", request_id=request.request_id, tier=request.tier.value)
        return decision

    @staticmethod
    def _not_forwarded(decision: Admitted, exc: BaseException) -> Rejected:
        log.error(
            "request.not_forwarded", request_id=decision.request.request_id, error=_describe(exc)
        )
        return not_forwarded(decision, _describe(exc))

    async def _forward(self, sending: _Sending) -> Rejected | None:
        """Write an admitted record whose batched write failed, retrying until stored."""
        decision = sending.decision
        request = decision.request
        if sending.replies is not None:
            return await self._forward_answer(sending)
        try:
            await self._retrying(
                f"publish to {decision.topic}",
                lambda: self.producer.send_and_wait(
                    decision.topic,
                    decision.value,
                    key=key_of(request.request_id),
                    headers=sending.headers,
                ),
            )
        except PERMANENT as exc:
            return self._not_forwarded(decision, exc)
        return None

    async def _forward_answer(self, sending: _Sending) -> Rejected | None:
        """Write a cache hit's whole stream again, in order, each record until stored.

        Records written before the failure are written again identically (same attempt
        and `seq`): readers drop them as duplicates, as they do a worker's retried writes.
        """
        decision = sending.decision
        try:
            for value, headers in sending.replies or []:
                await self._retrying(
                    f"publish to {decision.request.reply_to.topic}",
                    lambda: self._write_reply(decision, value, headers),  # noqa: B023
                )
        except PERMANENT as exc:
            return self._not_forwarded(decision, exc)
        return None

    async def _failed(self, record: Record, source: Source, exc: Exception) -> Rejected:
        # A defect, not the record's fault alone: still, no record may stop the flow.
        log.exception("record.failed", source=str(source), error=_describe(exc))
        rejected = Rejected(
            Reason.internal, ErrorCode.internal, "ingest failed on this record", None, None
        )
        await self._reject(rejected, record, source, None)
        return rejected

    async def _reject(
        self,
        rejected: Rejected,
        record: Record,
        source: Source,
        reply_problem: str | None,
    ) -> None:
        status = ReplyStatus.undeliverable if reply_problem else ReplyStatus.none
        error = rejected.error_result()
        if error is not None and rejected.reply_to is not None:
            reply_problem = await self._reply(rejected.reply_to, error)
            status = ReplyStatus.undeliverable if reply_problem else ReplyStatus.delivered
        # The DLQ must take it: it is the only way this record ends (and what the memory
        # reads back), so it is retried until stored; a refusal needs an operator.
        await dead_letter(
            self.producer,
            self.topics.dlq,
            rejected.dead_letter(
                record.value or b"",
                record.key,
                source,
                status,
                reply_problem,
                max_record_bytes=self.settings.ingest_max_record_bytes,
                reader=self._reader,
            ),
            within_s=None,
            backoff=Backoff(*self._backoff_s),
        )
        self.memory.dead_lettered.remember(source.position)
        log.info(
            "request.rejected",
            request_id=rejected.request_id,
            reason=rejected.reason.value,
            reply=status.value,
            source=str(source),
            error=rejected.message,
        )

    async def _reply(self, reply_to: ReplyTo, error: ErrorResult) -> str | None:
        """Write the error result to `reply_to`; None once written, else why it cannot be.

        Each write waits at most `ingest_reply_timeout_ms`. A failed write to a destination
        that still checks out is tried `ingest_reply_attempts` times; while the broker does
        not answer at all it is retried without limit (the outage, not the destination).
        """
        failures, last = 0, ""
        while True:
            try:
                await asyncio.wait_for(
                    self.producer.send_and_wait(
                        reply_to.topic,
                        encode(error),
                        key=key_of(error.request_id),
                        partition=reply_to.partition,
                    ),
                    self.settings.reply_timeout_s,
                )
                return None
            except PERMANENT as exc:
                return f"reply_to {reply_to.topic} refused the error: {_describe(exc)}"
            except TRANSIENT as exc:
                failures += 1
                last = _describe(exc)
                log.warning(
                    "reply.failed", request_id=error.request_id, error=last, failures=failures
                )
                await self.producer.settled()
            self.reply_targets.forget(reply_to.topic)
            verdict = await self._retrying(
                f"check reply_to {reply_to.topic}", lambda: self.reply_targets.check(reply_to)
            )
            if verdict is not None:
                return verdict.why
            if failures >= self.settings.ingest_reply_attempts:
                return f"reply_to {reply_to.topic} not written after {failures} tries: {last}"

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()` until it succeeds; a PERMANENT failure is raised, not retried."""
        backoff = Backoff(*self._backoff_s)
        while True:
            try:
                return await attempt()
            except PERMANENT:
                raise
            except TRANSIENT as exc:
                delay = backoff.next()
                log.warning("kafka.retrying", what=what, error=_describe(exc), retry_in_s=delay)
                # A broken producer is being replaced (shared/producers.py): retry on the new one.
                await self.producer.settled()
                await asyncio.sleep(delay)


class _Seen:
    """Request ids handed on: those remembered, and those admitted earlier in this batch."""

    def __init__(self, memory: Memory, in_batch: set[str]) -> None:
        self._memory = memory
        self._in_batch = in_batch

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._in_batch or request_id in self._memory.forwarded


def _observed(future: asyncio.Future[RecordMetadata]) -> None:
    """Retrieve a dropped future's outcome: its stream is written again whole."""
    if not future.cancelled():
        future.exception()


# The rejection reason of each way a `reply_to` cannot be written.
_REASONS = {
    Unwritable.missing: Reason.reply_to_missing,
    Unwritable.forbidden: Reason.reply_to_forbidden,
    Unwritable.out_of_range: Reason.reply_to_partition,
}


def _reply_to(decision: Admitted | Rejected) -> ReplyTo | None:
    if isinstance(decision, Admitted):
        return decision.request.reply_to
    return decision.reply_to if decision.error_result() is not None else None


def _describe(exc: BaseException) -> str:
    """An exception as a log/header value: its class and message, one bounded line."""
    text = str(exc).replace("\n", " ")
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__
