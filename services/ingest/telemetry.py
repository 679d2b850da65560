"""Ingest's part of a request's trace and metrics: the consume span, the `admit` stage, counts.

Per admitted record, one consumer span continues the producer's `traceparent` (its context
goes on in the tier record's headers, which the caller attaches), and one `admit` stage span
tiles the request's life from the record's creation to its admission to a tier; both are
recorded as its tier record is written. Observes only: it returns headers for the caller to
write, and never writes or changes a record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiokafka import ConsumerRecord
from opentelemetry.trace import SpanKind, Tracer

from services.ingest.admission import Admitted, Decision, Duplicate
from shared import semconv
from shared.metrics import IngestMetrics, ingest_metrics
from shared.telemetry import Headers, extract, inject, record_span, tracer


@dataclass
class IngestTelemetry:
    """Caller: ingest's reader and handling, on the event loop. Affects: metrics and spans."""

    requests_topic: str
    metrics: IngestMetrics = field(default_factory=ingest_metrics)
    tracer: Tracer = field(default_factory=tracer)

    def tier_headers(self, record: ConsumerRecord[bytes, bytes], decision: Admitted) -> Headers:
        """The spans of an admitted record; returns the headers its tier record carries.

        Both continue the producer's span (the record's own `traceparent`): the consume span,
        whose context the tier record carries on, and the `admit` stage. With no tracing
        installed the producer's context is passed on unchanged.
        """
        request = decision.request
        producer = extract(record.headers)
        now = time.time()
        context = record_span(
            semconv.messaging_span_name("process", self.requests_topic),
            start=now,
            end=now,
            context=producer,
            kind=SpanKind.CONSUMER,
            attributes={
                semconv.MESSAGING_SYSTEM: semconv.MESSAGING_SYSTEM_KAFKA,
                semconv.MESSAGING_DESTINATION_NAME: self.requests_topic,
                semconv.MESSAGING_OPERATION_TYPE: "process",
                semconv.REQUEST_ID: request.request_id,
            },
            tracer_=self.tracer,
        )
        record_span(
            semconv.stage_span_name(semconv.STAGE_ADMIT),
            start=request.created_at,
            end=request.accepted_at,
            # The producer's span: the stage covers the hop through the requests topic.
            context=producer,
            attributes={
                semconv.STAGE: semconv.STAGE_ADMIT,
                semconv.REQUEST_ID: request.request_id,
                semconv.TIER: request.tier.value,
                semconv.ADMISSION: "admitted",
                semconv.MESSAGING_DESTINATION_NAME: decision.topic,
            },
            tracer_=self.tracer,
        )
        return inject(context=context)

    def decided(self, decision: Decision) -> None:
        """Count one decision, once it is carried out."""
        metrics = self.metrics
        if isinstance(decision, Admitted):
            request = decision.request
            tier = request.tier.value
            # A response-cache hit is answered here and never reaches its tier.
            outcome = "cached" if decision.answer is not None else "admitted"
            metrics.records.labels(outcome, tier).inc()
            metrics.admit.labels(tier).observe(max(0.0, request.accepted_at - request.created_at))
        elif isinstance(decision, Duplicate):
            metrics.records.labels("duplicate", "none").inc()
        else:
            metrics.records.labels("rejected", "none").inc()
