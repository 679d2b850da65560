"""The edge's part of a request's trace and metrics: where the trace starts and where it ends.

A request's root span (`chat`, SERVER) opens when its frame is read and closes when its
final frame is written to the socket; between, the edge records the `accept` stage, the
producer span of the request record (whose context rides in the record's headers), and at
the end the `deliver` stage: from the moment the worker wrote the final result record (its
Kafka create time) to the frame on the socket, as a child of the worker's span.

One `EdgeTelemetry` per edge: the results reader, the sockets and the submit path report
to it; its metrics go to the edge's own registry (its `/metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from services.edge.protocol import DeltaFrame, DoneFrame, ErrorFrame, ServerFrame
from shared import semconv
from shared.kafka import encode, key_of
from shared.messages import RequestRecord
from shared.metrics import EdgeRequestMetrics, edge_metrics
from shared.telemetry import extract, has_trace, inject, record_span, sent_at, tracer

STALE_AFTER_S = 3600.0  # a request whose socket went away is forgotten after this


@dataclass
class InFlight:
    root: Span
    context: Context  # the root span's
    tier: str
    started: float
    first_delta: bool = False
    # The latest result record of the request: its create time and the context it carried.
    last_record: tuple[float, Context] | None = None


@dataclass
class EdgeTelemetry:
    metrics: EdgeRequestMetrics = field(default_factory=edge_metrics)
    tracer: Tracer = field(default_factory=tracer)
    clock: Callable[[], float] = time.time
    # Lag is measured on the shared results topic only: per-request topics would each make
    # a label value of their own.
    results_topic: str | None = None
    _flights: dict[str, InFlight] = field(default_factory=dict)

    def begin(
        self,
        request_id: str,
        *,
        tier: str,
        max_tokens: int | None,
        parent: Mapping[str, str] | None = None,
    ) -> None:
        """A request frame was read: open its root span (continuing `parent`'s trace, if any)."""
        now = self.clock()
        self._forget_stale(now)
        parent_ctx = extract(parent) if parent else Context()
        attributes: dict[str, Any] = {
            semconv.GEN_AI_OPERATION_NAME: "chat",
            semconv.REQUEST_ID: request_id,
            semconv.TIER: tier,
        }
        if max_tokens is not None:
            attributes[semconv.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
        root = self.tracer.start_span(
            semconv.SPAN_CHAT,
            context=parent_ctx,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=int(now * 1e9),
        )
        context = trace.set_span_in_context(root, parent_ctx)
        self._flights[request_id] = InFlight(root, context, tier, now)
        self.metrics.in_flight.inc()

    async def publish(self, producer: AIOKafkaProducer, topic: str, record: RequestRecord) -> None:
        """Write the request record with its trace context; a failure ends the trace."""
        flight = self._flights.get(record.request_id)
        context = flight.context if flight is not None else Context()
        if flight is not None:
            record_span(
                semconv.stage_span_name(semconv.STAGE_ACCEPT),
                start=flight.started,
                end=record.created_at,
                context=context,
                attributes={
                    semconv.STAGE: semconv.STAGE_ACCEPT,
                    semconv.REQUEST_ID: record.request_id,
                },
                tracer_=self.tracer,
            )
        span = self.tracer.start_span(
            semconv.messaging_span_name("send", topic),
            context=context,
            kind=SpanKind.PRODUCER,
            attributes={
                semconv.MESSAGING_SYSTEM: semconv.MESSAGING_SYSTEM_KAFKA,
                semconv.MESSAGING_DESTINATION_NAME: topic,
                semconv.MESSAGING_OPERATION_TYPE: "send",
                semconv.MESSAGING_KAFKA_MESSAGE_KEY: record.request_id,
                semconv.REQUEST_ID: record.request_id,
            },
        )
        try:
            await producer.send_and_wait(
                topic,
                encode(record),
                key=key_of(record.request_id),
                headers=inject(context=trace.set_span_in_context(span, context)),
            )
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR))
            self._end(record.request_id, outcome="produce_failed", error=type(exc).__name__)
            raise
        finally:
            span.end()
        if flight is not None:
            self.metrics.requests.labels(flight.tier).inc()

    def fetched(self, consumer: Any, fetched: Mapping[Any, Sequence[Any]]) -> None:
        """After a fetch of result records: lag, and the latest record of each request."""
        for tp, records in fetched.items():
            for record in records:
                self.result_record(consumer, tp, record)

    def result_record(self, consumer: Any, tp: Any, record: Any) -> None:
        """One result record read (before it is routed): lag, and when the worker wrote it."""
        if record.topic == self.results_topic:
            self.metrics.lag.observe_record(consumer, record, tp)
        request_id = record.key.decode(errors="replace") if record.key else None
        flight = self._flights.get(request_id) if request_id else None
        if flight is not None:
            written_at = sent_at(record.headers, fallback=record.timestamp / 1000)
            flight.last_record = (written_at, extract(record.headers))

    def end(self, request_id: str, *, outcome: str) -> None:
        """The request ended before any result (no stream could be opened for it)."""
        self._end(request_id, outcome=outcome, error=outcome)

    def frame_written(self, frame: ServerFrame) -> None:
        """A frame reached the socket: the first delta and the final frame are measured."""
        request_id = getattr(frame, "request_id", None)
        flight = self._flights.get(request_id) if request_id else None
        if flight is None or request_id is None:
            return
        now = self.clock()
        if isinstance(frame, DeltaFrame):
            if not flight.first_delta:
                flight.first_delta = True
                self.metrics.first_delta.labels(flight.tier).observe(now - flight.started)
            return
        if not isinstance(frame, DoneFrame | ErrorFrame):
            return
        if flight.last_record is not None:
            written_at, carried = flight.last_record
            parent = carried if has_trace(carried) else flight.context
            record_span(
                semconv.stage_span_name(semconv.STAGE_DELIVER),
                start=written_at,
                end=now,
                context=parent,
                attributes={semconv.STAGE: semconv.STAGE_DELIVER, semconv.REQUEST_ID: request_id},
                tracer_=self.tracer,
            )
            self.metrics.delivery.labels(flight.tier).observe(max(0.0, now - written_at))
        if isinstance(frame, DoneFrame):
            flight.root.set_attributes(
                {
                    semconv.GEN_AI_RESPONSE_FINISH_REASONS: [frame.finish_reason],
                    semconv.GEN_AI_USAGE_INPUT_TOKENS: frame.usage.prompt_tokens,
                    semconv.GEN_AI_USAGE_OUTPUT_TOKENS: frame.usage.completion_tokens,
                }
            )
            self._end(request_id, outcome=frame.finish_reason, now=now)
        else:
            self._end(request_id, outcome=frame.code.value, error=frame.code.value, now=now)

    def _end(
        self, request_id: str, *, outcome: str, error: str | None = None, now: float | None = None
    ) -> None:
        flight = self._flights.pop(request_id, None)
        if flight is None:
            return
        now = self.clock() if now is None else now
        if error is not None:
            flight.root.set_attribute(semconv.ERROR_TYPE, error)
            flight.root.set_status(Status(StatusCode.ERROR))
        flight.root.end(end_time=int(now * 1e9))
        self.metrics.in_flight.dec()
        self.metrics.responses.labels(flight.tier, outcome).inc()
        if outcome != "abandoned":  # a socket that went away says nothing about latency
            self.metrics.duration.labels(flight.tier).observe(now - flight.started)

    def _forget_stale(self, now: float) -> None:
        stale = [rid for rid, f in self._flights.items() if now - f.started > STALE_AFTER_S]
        for rid in stale:
            self._end(rid, outcome="abandoned", error="abandoned", now=now)

    def __len__(self) -> int:
        return len(self._flights)
