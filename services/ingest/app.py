"""The ingest process (FastStream): requests in, tier topics or the DLQ out."""

from __future__ import annotations

import structlog
from faststream import AckPolicy, FastStream
from faststream.kafka.annotations import KafkaMessage
from faststream.kafka.opentelemetry import KafkaTelemetryMiddleware

from services.ingest.admission import Admitted, Duplicate, RecentIds, admit
from services.ingest.settings import IngestSettings
from services.ingest.telemetry import observe_admission
from shared.kafka import encode, key_of, make_faststream_broker
from shared.topics import Topics

log = structlog.get_logger()


def build_app(settings: IngestSettings) -> FastStream:
    topics = Topics(settings.topic_prefix)
    limits = settings.limits()
    recent = RecentIds(settings.ingest_dedupe_window)
    broker = make_faststream_broker(
        settings,
        client_id="ingest",
        # Traces each record (continuing its `traceparent`) and every publish: the only
        # tracing of ingest's Kafka I/O, so nothing below propagates trace headers by hand.
        middlewares=(KafkaTelemetryMiddleware(),),
    )

    # NACK_ON_ERROR: a failed publish seeks back, so the record is retried, never skipped.
    @broker.subscriber(
        topics.requests,
        group_id=f"{settings.topic_prefix}.ingest",
        auto_offset_reset="earliest",
        ack_policy=AckPolicy.NACK_ON_ERROR,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
    )
    async def on_request(message: KafkaMessage) -> None:
        raw = message.raw_message
        if isinstance(raw, tuple):  # only batch subscribers get several records at once
            raise TypeError("ingest subscribes one record at a time")
        decision = admit(raw.value or b"", raw.key, topics, limits, recent)
        observe_admission(decision, message)
        if isinstance(decision, Admitted):
            request = decision.request
            await broker.publish(
                encode(request),
                topic=decision.topic,
                key=key_of(request.request_id),
            )
            log.info("request.admitted", request_id=request.request_id, tier=request.tier.value)
            return
        if isinstance(decision, Duplicate):
            log.info("request.duplicate", request_id=decision.request_id)
            return
        await broker.publish(
            raw.value or b"",
            topic=topics.dlq,
            key=raw.key,
            headers={
                "tokenbus-error-code": decision.code.value,
                "tokenbus-error": decision.message[:1000],
                "tokenbus-source": f"{raw.topic}/{raw.partition}/{raw.offset}",
            },
        )
        error = decision.error_result()
        if error is not None and decision.reply_to is not None:
            await broker.publish(
                encode(error),
                topic=decision.reply_to.topic,
                partition=decision.reply_to.partition,
                key=key_of(error.request_id),
            )
        log.info("request.rejected", request_id=decision.request_id, error=decision.message)

    return FastStream(broker, logger=None)
