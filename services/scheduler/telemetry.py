"""The scheduler's part of the traces and metrics: queue wait, batch formation, the batch span.

Per request, two stage spans continue the request's trace: `queue_wait` (admitted to the
tier topic -> its bus leaves) and `batch_form` (bus leaves -> the batch record is formed);
the latter's context goes to the worker in the request's `trace` field of the batch. Per
batch, one `send` span in a trace of its own, linked to every request it carries (the
messaging conventions for a batch), whose context rides in the batch record's headers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Tracer, set_span_in_context

from shared import semconv
from shared.messages import Batch, QueuedRequest, Tier
from shared.metrics import SchedulerMetrics, scheduler_metrics
from shared.telemetry import (
    Headers,
    carrier,
    context_from,
    extract,
    has_trace,
    inject,
    ns,
    record_span,
    span_context_of,
    tracer,
)


@dataclass
class SchedulerTelemetry:
    topic: str  # where batches go
    max_batch_size: Mapping[Tier, int]
    metrics: SchedulerMetrics = field(default_factory=scheduler_metrics)
    tracer: Tracer = field(default_factory=tracer)
    _waiting: dict[str, Tier] = field(default_factory=dict)
    _sending: dict[str, Span] = field(default_factory=dict)

    def fetched(self, consumer: Any, fetched: Mapping[Any, Sequence[Any]]) -> None:
        self.metrics.lag.observe(consumer, fetched)

    def arrived(
        self, request: QueuedRequest, headers: Sequence[tuple[str, bytes]]
    ) -> QueuedRequest:
        """A request read from a tier topic; it keeps the trace context its record carried.

        The record's headers win; a record without them (a request handed back by a worker)
        keeps the context already in its `trace` field.
        """
        incoming = extract(headers)
        if has_trace(incoming):
            request = request.model_copy(update={"trace": carrier(incoming)})
        if request.request_id not in self._waiting:
            self._waiting[request.request_id] = request.tier
            self.metrics.queue_depth.labels(request.tier.value).inc()
        return request

    def expired(self, request: QueuedRequest) -> None:
        self._leave(request.request_id)
        self.metrics.expired.labels(request.tier.value).inc()

    def released(self, request: QueuedRequest) -> None:
        """A waiting request this process gives up (its partition moved to another scheduler)."""
        self._leave(request.request_id)

    def batch_formed(self, batch: Batch, departed_at: float) -> tuple[Batch, Headers]:
        """Record each request's stages and the batch span; return the batch to send, whose
        requests carry their `batch_form` context, and the headers carrying the batch span's.
        """
        t = self.tracer
        tier = batch.tier.value
        formed: list[QueuedRequest] = []
        links: list[Link] = []
        for request in batch.requests:
            incoming = context_from(request.trace)
            common = {semconv.REQUEST_ID: request.request_id, semconv.TIER: tier}
            record_span(
                semconv.stage_span_name(semconv.STAGE_QUEUE_WAIT),
                start=request.accepted_at,
                end=departed_at,
                context=incoming,
                attributes={semconv.STAGE: semconv.STAGE_QUEUE_WAIT, **common},
                tracer_=t,
            )
            form_ctx = record_span(
                semconv.stage_span_name(semconv.STAGE_BATCH_FORM),
                start=departed_at,
                end=batch.formed_at,
                context=incoming,
                attributes={
                    semconv.STAGE: semconv.STAGE_BATCH_FORM,
                    semconv.BATCH_ID: batch.batch_id,
                    semconv.BATCH_REASON: batch.reason,
                    **common,
                },
                tracer_=t,
            )
            links.append(Link(span_context_of(form_ctx), {semconv.REQUEST_ID: request.request_id}))
            formed.append(request.model_copy(update={"trace": carrier(form_ctx)}))
            self._leave(request.request_id)
            self.metrics.queue_wait.labels(tier).observe(
                max(0.0, departed_at - request.accepted_at)
            )
        size = len(batch.requests)
        fill = size / max(1, self.max_batch_size.get(batch.tier, size))
        self.metrics.batch_size.labels(tier).observe(size)
        self.metrics.fill_ratio.labels(tier).observe(min(1.0, fill))
        self.metrics.batches.labels(tier, batch.reason).inc()
        # A trace of its own (the batch is not any one request's), linked to all of them.
        span = t.start_span(
            semconv.messaging_span_name(semconv.SPAN_BATCH_SEND, self.topic),
            context=Context(),
            kind=SpanKind.PRODUCER,
            links=[link for link in links if link.context.is_valid],
            start_time=ns(departed_at),
            attributes={
                semconv.MESSAGING_SYSTEM: semconv.MESSAGING_SYSTEM_KAFKA,
                semconv.MESSAGING_DESTINATION_NAME: self.topic,
                semconv.MESSAGING_OPERATION_TYPE: "send",
                semconv.MESSAGING_BATCH_MESSAGE_COUNT: size,
                semconv.MESSAGING_KAFKA_MESSAGE_KEY: batch.batch_id,
                semconv.BATCH_ID: batch.batch_id,
                semconv.BATCH_SIZE: size,
                semconv.BATCH_REASON: batch.reason,
                semconv.BATCH_FILL_RATIO: round(fill, 4),
                semconv.TIER: tier,
            },
        )
        self._sending[batch.batch_id] = span
        headers = inject(context=set_span_in_context(span))
        return batch.model_copy(update={"requests": formed}), headers

    def batch_sent(self, batch: Batch) -> None:
        span = self._sending.pop(batch.batch_id, None)
        if span is not None:
            span.end(end_time=ns(time.time()))

    def _leave(self, request_id: str) -> None:
        tier = self._waiting.pop(request_id, None)
        if tier is not None:
            self.metrics.queue_depth.labels(tier.value).dec()
