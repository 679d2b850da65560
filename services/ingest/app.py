"""The ingest process (FastStream): requests in, tier topics or the DLQ out, every record once.

Each record ends in exactly one outcome: forwarded to its tier once, or dead-lettered once
with an error to its `reply_to` when that can be delivered. The handler never raises for a
record: a transient Kafka failure is retried in place with backoff (nothing is skipped),
anything else about the record is a rejection (so nothing is retried forever).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog
from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    InvalidProducerEpoch,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    UnknownProducerId,
)
from faststream import AckPolicy, FastStream
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from faststream.kafka.opentelemetry import KafkaTelemetryMiddleware
from faststream.kafka.publisher.producer import AioKafkaFastProducerImpl
from faststream.message import StreamMessage

from services.ingest.admission import (
    Admitted,
    Decision,
    Duplicate,
    Reason,
    Rejected,
    admit,
    not_forwarded,
    undeliverable,
    without_reply,
)
from services.ingest.dead_letter import ReplyStatus, Source, dead_letter
from services.ingest.destinations import MetadataUnavailable, ReplyDestinations
from services.ingest.memory import Memory, recall
from services.ingest.settings import IngestSettings
from services.ingest.telemetry import observe_admission
from shared.kafka import (
    encode,
    key_of,
    make_admin,
    make_faststream_broker,
    make_producer,
    wait_for_broker,
)
from shared.messages import ErrorCode, ErrorResult, ReplyTo
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
# The idempotent producer's own state is broken (aiokafka does not recover from these,
# e.g. after a batch expired in an outage): only a new producer can write again.
BROKEN_PRODUCER = (
    OutOfOrderSequenceNumber,
    UnknownProducerId,
    InvalidProducerEpoch,
    ProducerFenced,
)
# Failures that pass: the broker or its metadata did not answer (yet).
TRANSIENT = (KafkaError, MetadataUnavailable, TimeoutError, OSError)
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    first_s: float
    max_s: float

    def after(self, delay_s: float) -> float:
        return min(self.max_s, max(self.first_s, delay_s * 2))


async def serve(
    settings: IngestSettings, built: Callable[[FastStream], None] = lambda app: None
) -> None:
    """Wait for the broker, build the clients, run until SIGTERM/SIGINT; `built` is shown
    the app before it runs (its consumers are what `/readyz` looks at)."""
    while True:
        try:
            await wait_for_broker(settings, timeout_s=60)
            break
        except TimeoutError as exc:
            log.warning("broker.unreachable", error=str(exc))
    admin = make_admin(settings, client_id="ingest-admin")
    await admin.start()
    try:
        app = build_app(settings, admin)
        built(app)
        await app.run()
    finally:
        await admin.close()


def build_app(settings: IngestSettings, admin: AIOKafkaAdminClient) -> FastStream:
    broker = make_faststream_broker(
        settings,
        client_id="ingest",
        request_timeout_ms=settings.ingest_publish_timeout_ms,
        # Traces each record (continuing its `traceparent`) and every publish: the only
        # tracing of ingest's Kafka I/O, so nothing below propagates trace headers by hand.
        middlewares=(KafkaTelemetryMiddleware(),),
    )
    ingest = Ingest(settings, broker, admin)

    # The handler never raises for a record, so NACK_ON_ERROR only rewinds a record whose
    # handling was interrupted (shutdown): it is read again, never skipped.
    @broker.subscriber(
        ingest.topics.requests,
        group_id=f"{settings.topic_prefix}.ingest",
        auto_offset_reset="earliest",
        ack_policy=AckPolicy.NACK_ON_ERROR,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        listener=RecallOnAssignment(ingest.recall),
        parser=tolerant_headers,
        decoder=raw_body,
    )
    async def on_request(message: KafkaMessage) -> None:
        raw = message.raw_message
        if isinstance(raw, tuple):  # only batch subscribers get several records at once
            raise TypeError("ingest subscribes one record at a time")
        decision = await ingest.handle(raw)
        if decision is not None:
            observe_admission(decision, message)

    return FastStream(broker, logger=None)


class Ingest:
    """One record at a time: decide, check where it may go, hand it on, remember it.

    Owner of `memory` (what was handed on) and of the broker's publishes.
    """

    def __init__(
        self, settings: IngestSettings, broker: KafkaBroker, admin: AIOKafkaAdminClient
    ) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.limits = settings.limits()
        self.memory = Memory.of_size(settings.ingest_dedupe_window)
        self.broker = broker
        self.admin = admin
        self._recalled = asyncio.Event()
        self.destinations = ReplyDestinations(
            admin, settings.reply_timeout_s, grace_s=settings.ingest_reply_to_grace_ms / 1000
        )
        self.backoff = Backoff(
            settings.ingest_retry_backoff_ms / 1000, settings.ingest_retry_backoff_max_ms / 1000
        )

    async def recall(self) -> None:
        """Refill the memory from the tier topics and the DLQ; retried until it succeeds,
        since forwarding without it could run a request twice.

        aiokafka may hand out records of a new assignment while its listener still runs,
        so `handle` waits for `_recalled` rather than trusting the listener's order.
        """
        self._recalled.clear()
        delay = 0.0
        while True:
            try:
                await recall(
                    self.memory,
                    self.topics,
                    self.admin,
                    self.settings,
                    self.settings.ingest_dedupe_window,
                )
                self._recalled.set()
                return
            except Exception as exc:
                delay = self.backoff.after(delay)
                log.warning("memory.recall_failed", error=_describe(exc), retry_in_s=delay)
                await asyncio.sleep(delay)

    async def handle(self, record: ConsumerRecord[bytes, bytes]) -> Decision | None:
        """Hand one record on; None when it was dead-lettered before (a redelivery)."""
        await self._recalled.wait()
        source = Source(record.topic, record.partition, record.offset)
        if (source.partition, source.offset) in self.memory.dead_lettered:
            log.info("record.already_dead_lettered", source=str(source))
            return None
        value = record.value or b""
        try:
            return await self._handle(value, record.key, source)
        except TRANSIENT:
            raise  # only from shutdown: the record is read again
        except Exception as exc:
            # A defect, not the record's fault alone: still, no record may stop the flow.
            log.exception("record.failed", source=str(source), error=_describe(exc))
            rejected = Rejected(
                Reason.internal, ErrorCode.internal, "ingest failed on this record", None, None
            )
            await self._reject(rejected, value, record.key, source, None)
            return rejected

    async def _handle(self, value: bytes, key: bytes | None, source: Source) -> Decision:
        # 1) Decide from the record alone.
        decision = admit(
            value,
            key,
            self.topics,
            self.limits,
            self.memory.forwarded,
            max_record_bytes=self.settings.ingest_max_record_bytes,
        )
        if isinstance(decision, Duplicate):
            log.info("request.duplicate", request_id=decision.request_id, source=str(source))
            return decision
        # 2) Nothing is forwarded or answered whose results could not be delivered.
        reply_problem = None
        reply_to = _reply_to(decision)
        if reply_to is not None:
            verdict = await self._retrying(
                f"check reply_to {reply_to.topic}", lambda: self.destinations.check(reply_to)
            )
            if verdict is not None:
                reply_problem = verdict.why
                decision = (
                    undeliverable(decision, verdict.reason, verdict.why)
                    if isinstance(decision, Admitted)
                    else without_reply(decision)
                )
        # 3) Forward; a tier topic that refuses the record for good makes it a rejection.
        if isinstance(decision, Admitted):
            refused = await self._forward(decision)
            if refused is None:
                return decision
            decision = refused
        # 4) Tell the requester, then dead-letter the record (last: it marks the end).
        await self._reject(decision, value, key, source, reply_problem)
        return decision

    async def _forward(self, decision: Admitted) -> Rejected | None:
        request = decision.request
        try:
            await self._retrying(
                f"publish to {decision.topic}",
                lambda: self.broker.publish(
                    decision.value, topic=decision.topic, key=key_of(request.request_id)
                ),
            )
        except PERMANENT as exc:
            log.error("request.not_forwarded", request_id=request.request_id, error=_describe(exc))
            return not_forwarded(decision, _describe(exc))
        # Remembered only now that a tier holds it: a failed publish is retried, not dropped.
        self.memory.forwarded.remember(request.request_id)
        log.info("request.admitted", request_id=request.request_id, tier=request.tier.value)
        return None

    async def _reject(
        self,
        rejected: Rejected,
        value: bytes,
        key: bytes | None,
        source: Source,
        reply_problem: str | None,
    ) -> None:
        status = ReplyStatus.undeliverable if reply_problem else ReplyStatus.none
        error = rejected.error_result()
        if error is not None and rejected.reply_to is not None:
            reply_problem = await self._reply(rejected.reply_to, error)
            status = ReplyStatus.undeliverable if reply_problem else ReplyStatus.delivered
        letter = dead_letter(
            value,
            key,
            source,
            rejected,
            status,
            reply_problem,
            self.settings.ingest_max_record_bytes,
        )
        while True:
            try:
                await self._retrying(
                    f"publish to {self.topics.dlq}",
                    lambda: self.broker.publish(
                        letter.value, topic=self.topics.dlq, key=letter.key, headers=letter.headers
                    ),
                )
                break
            except PERMANENT as exc:
                # The DLQ must take it: it is the only way this record ends. An operator
                # has to fix the DLQ topic (its permissions or size limit); keep trying.
                log.error("dlq.refused", source=str(source), error=_describe(exc))
                await asyncio.sleep(self.backoff.max_s)
        self.memory.dead_lettered.remember((source.partition, source.offset))
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
                    self.broker.publish(
                        encode(error),
                        topic=reply_to.topic,
                        partition=reply_to.partition,
                        key=key_of(error.request_id),
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
                if isinstance(exc, BROKEN_PRODUCER):
                    await self._renew_producer()
            self.destinations.forget(reply_to.topic)
            verdict = await self._retrying(
                f"check reply_to {reply_to.topic}", lambda: self.destinations.check(reply_to)
            )
            if verdict is not None:
                return verdict.why
            if failures >= self.settings.ingest_reply_attempts:
                return f"reply_to {reply_to.topic} not written after {failures} tries: {last}"

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()` until it succeeds; a PERMANENT failure is raised, not retried."""
        delay = 0.0
        while True:
            try:
                return await attempt()
            except PERMANENT:
                raise
            except TRANSIENT as exc:
                delay = self.backoff.after(delay)
                log.warning("kafka.retrying", what=what, error=_describe(exc), retry_in_s=delay)
                if isinstance(exc, BROKEN_PRODUCER):
                    await self._renew_producer()
                await asyncio.sleep(delay)

    async def _renew_producer(self) -> None:
        """Replace the broker's producer with a new one (a new producer id and sequence).

        FastStream has no public call for this: its producer wrapper is reconnected with a
        producer from the same factory and settings as the broker's own.
        """
        wrapper = self.broker.config.producer
        if not isinstance(wrapper, AioKafkaFastProducerImpl):
            raise TypeError(f"cannot renew a {type(wrapper).__name__}")
        await wrapper.disconnect()
        await wrapper.connect(
            make_producer(
                self.settings,
                client_id="ingest",
                request_timeout_ms=self.settings.ingest_publish_timeout_ms,
            ),
            serializer=None,
        )
        log.warning("producer.renewed")


def _reply_to(decision: Admitted | Rejected) -> ReplyTo | None:
    if isinstance(decision, Admitted):
        return decision.request.reply_to
    return decision.reply_to if decision.error_result() is not None else None


def _describe(exc: BaseException) -> str:
    """An exception as a log/header value: its class and message, one bounded line."""
    text = str(exc).replace("\n", " ")
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


class RecallOnAssignment(ConsumerRebalanceListener):  # type: ignore[misc]
    """Refills ingest's memory before it reads any newly assigned partition."""

    def __init__(self, recall: Callable[[], Awaitable[None]]) -> None:
        self._recall = recall

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        return None

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        if assigned:
            await self._recall()


async def tolerant_headers(
    record: ConsumerRecord[bytes, bytes],
    parse: Callable[[ConsumerRecord[bytes, bytes]], Awaitable[StreamMessage[object]]],
) -> StreamMessage[object]:
    """FastStream's parser, for records whose headers are not all UTF-8 text.

    FastStream decodes every header value before the handler runs; one that is not UTF-8
    (or null) would fail every delivery of the record. Such values are replaced with their
    escaped text, so the record reaches admission like any other.
    """
    if all(isinstance(v, bytes) and _is_utf8(v) for _, v in record.headers):
        return await parse(record)
    record.headers = tuple(
        (k, (v or b"").decode("utf-8", "backslashreplace").encode()) for k, v in record.headers
    )
    return await parse(record)


async def raw_body(
    message: StreamMessage[object], decode: Callable[[StreamMessage[object]], Awaitable[object]]
) -> object:
    """The record's bytes, undecoded: FastStream's own decoder parses JSON (or text, by the
    `content-type` header) before the handler, and would fail on the very records ingest
    must dead-letter. Admission parses the bytes itself."""
    return message.body


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
