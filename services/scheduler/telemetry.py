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

from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Tracer, set_span_in_context

from shared import semconv
from shared.messages import QueuedRequest, Tier
from shared.metrics import LabelValues, SchedulerMetrics, scheduler_metrics
from shared.telemetry import (
    Carrier,
    Headers,
    carrier,
    context_from,
    inject,
    ns,
    record_span,
    span_context_of,
    tracer,
)
from shared.variants import BASELINE, ModelRollout


@dataclass(frozen=True)
class BatchTrace:
    """What a formed batch's record carries of its trace: per request, the `trace` field
    (in the batch's order), and the batch span's headers."""

    request_traces: list[Carrier]
    headers: Headers


@dataclass
class SchedulerTelemetry:
    """Observes the scheduler; it returns trace contexts to attach, never sends or rewrites.

    Caller: the scheduler's tier reader and stepper, on one event loop.
    """

    topic: str  # where batches go
    max_batch_size: Mapping[Tier, int]
    metrics: SchedulerMetrics = field(default_factory=scheduler_metrics)
    tracer: Tracer = field(default_factory=tracer)
    _waiting: dict[str, Tier] = field(default_factory=dict)
    _sending: dict[str, Span] = field(default_factory=dict)
    _models: set[str] = field(default_factory=set)  # models whose queue depth is shown
    # Model and variant names come from requests: bounded as label values.
    _model: LabelValues = field(default_factory=LabelValues)
    _variant: LabelValues = field(default_factory=LabelValues)

    def arrived(self, request: QueuedRequest) -> None:
        """A request joined the backlog."""
        if request.request_id not in self._waiting:
            self._waiting[request.request_id] = request.tier
            self.metrics.queue_depth.labels(request.tier.value).inc()

    def expired(self, request: QueuedRequest) -> None:
        self._leave(request.request_id)
        self.metrics.expired.labels(request.tier.value).inc()

    def fell_back(self, request: QueuedRequest, model: str) -> None:
        """A waiting request moved to its fallback model."""
        self.metrics.fallbacks.labels(request.tier.value, self._model(model)).inc()

    def variant_chosen(self, model: str, variant: str | None) -> None:
        """A request was queued for a variant of its model (None: the baseline)."""
        label = self._variant(variant or BASELINE)
        self.metrics.variant_requests.labels(self._model(model), label).inc()

    def to_baseline(self, model: str, variant: str) -> None:
        """A waiting request moved from a variant without a live worker to the baseline."""
        self.metrics.variant_fallbacks.labels(self._model(model), self._variant(variant)).inc()

    def shares(self, rollout: ModelRollout) -> None:
        """A model's rollout as the scheduler now routes by it."""
        for name, percent in rollout.weights().items():
            self.metrics.variant_share.labels(rollout.model, name or BASELINE).set(percent)

    def waiting_by_model(self, waiting: Mapping[str | None, int]) -> None:
        """How many requests wait for each model now (None: any worker); a model no longer
        waited for shows 0, so its scaling signal reads 0 rather than nothing."""
        now: dict[str, int] = {}
        for model, count in waiting.items():
            label = self._model(model or "")
            now[label] = now.get(label, 0) + count
        for model in self._models | now.keys():
            self.metrics.model_queue_depth.labels(model).set(now.get(model, 0))
        self._models |= now.keys()

    def refused(self, request: QueuedRequest) -> None:
        """A waiting request answered with an error (its model is unknown, or has no live
        worker and the request cannot wait for one)."""
        self._leave(request.request_id)

    def released(self, request: QueuedRequest) -> None:
        """A waiting request this process gives up (its partition moved to another scheduler)."""
        self._leave(request.request_id)

    def batch_formed(
        self,
        *,
        batch_id: str,
        tier: Tier,
        reason: str,
        requests: Sequence[QueuedRequest],
        departed_at: float,
        formed_at: float,
    ) -> BatchTrace:
        """Record each request's stages and the batch span, for the batch about to be formed.

        Returns what the caller attaches to the record it writes: each request's `batch_form`
        context (its `trace` field in the batch, so the worker continues it) and the headers
        carrying the batch span's context. The batch itself is not changed.
        """
        t = self.tracer
        tier_name = tier.value
        traces: list[Carrier] = []
        links: list[Link] = []
        for request in requests:
            incoming = context_from(request.trace)
            common = {semconv.REQUEST_ID: request.request_id, semconv.TIER: tier_name}
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
                end=formed_at,
                context=incoming,
                attributes={
                    semconv.STAGE: semconv.STAGE_BATCH_FORM,
                    semconv.BATCH_ID: batch_id,
                    semconv.BATCH_REASON: reason,
                    **common,
                },
                tracer_=t,
            )
            links.append(Link(span_context_of(form_ctx), {semconv.REQUEST_ID: request.request_id}))
            traces.append(carrier(form_ctx))
            self._leave(request.request_id)
            self.metrics.queue_wait.labels(tier_name).observe(
                max(0.0, departed_at - request.accepted_at)
            )
        size = len(requests)
        fill = size / max(1, self.max_batch_size.get(tier, size))
        self.metrics.batch_size.labels(tier_name).observe(size)
        self.metrics.fill_ratio.labels(tier_name).observe(min(1.0, fill))
        self.metrics.batches.labels(tier_name, reason).inc()
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
                semconv.MESSAGING_KAFKA_MESSAGE_KEY: batch_id,
                semconv.BATCH_ID: batch_id,
                semconv.BATCH_SIZE: size,
                semconv.BATCH_REASON: reason,
                semconv.BATCH_FILL_RATIO: round(fill, 4),
                semconv.TIER: tier_name,
            },
        )
        self._sending[batch_id] = span
        return BatchTrace(traces, inject(context=set_span_in_context(span)))

    def batch_sent(self, batch_id: str) -> None:
        span = self._sending.pop(batch_id, None)
        if span is not None:
            span.end(end_time=ns(time.time()))

    def _leave(self, request_id: str) -> None:
        tier = self._waiting.pop(request_id, None)
        if tier is not None:
            self.metrics.queue_depth.labels(tier.value).dec()
