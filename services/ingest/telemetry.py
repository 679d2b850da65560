"""Ingest's part of a request's trace and metrics: the `admit` stage and admission counts.

FastStream's Kafka telemetry middleware traces the record itself (a process span continuing
the producer's `traceparent`, and the send span of the tier record); this adds the stage
that tiles the request's life: from the record's creation to its admission to a tier.
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition
from faststream.kafka.annotations import KafkaMessage

from services.ingest.admission import Admitted, Decision, Duplicate
from shared import semconv
from shared.metrics import ingest_metrics
from shared.telemetry import extract, record_span


def observe_admission(decision: Decision, message: KafkaMessage) -> None:
    """Count one decision; an admitted request gets its `admit` stage span."""
    raw = message.raw_message
    assert not isinstance(raw, tuple), "ingest consumes records one at a time"
    metrics = ingest_metrics()
    consumer = message.consumer
    if isinstance(consumer, AIOKafkaConsumer):
        metrics.lag.observe_record(consumer, raw, TopicPartition(raw.topic, raw.partition))
    if isinstance(decision, Admitted):
        request = decision.request
        tier = request.tier.value
        metrics.records.labels("admitted", tier).inc()
        metrics.admit.labels(tier).observe(max(0.0, request.accepted_at - request.created_at))
        record_span(
            semconv.stage_span_name(semconv.STAGE_ADMIT),
            start=request.created_at,
            end=request.accepted_at,
            # The producer's span: the stage covers the hop through the requests topic.
            context=extract(raw.headers),
            attributes={
                semconv.STAGE: semconv.STAGE_ADMIT,
                semconv.REQUEST_ID: request.request_id,
                semconv.TIER: tier,
                semconv.ADMISSION: "admitted",
                semconv.MESSAGING_DESTINATION_NAME: decision.topic,
            },
        )
    elif isinstance(decision, Duplicate):
        metrics.records.labels("duplicate", "none").inc()
    else:
        metrics.records.labels("rejected", "none").inc()
