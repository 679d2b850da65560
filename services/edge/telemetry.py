"""The edge's part of a request's trace and metrics: where the trace starts and where it ends.

A request's root span (`chat`, SERVER) opens when its frame is read and closes when its
final frame is written to the socket; between, the edge records the `accept` stage, the
producer span of the request record (whose context rides in the record's headers), and at
the end the `deliver` stage: from the moment the worker wrote the final result record (its
Kafka create time) to the frame on the socket, as a child of the worker's span.

One `EdgeTelemetry` per edge: the results reader, the clients' writers and the submit path
report to it; it observes only (it never sends or changes a record: `sending` returns the
headers the caller attaches). A request's `InFlight` lives in its stream (`streams.py`), so
nothing here is kept per request; its metrics go to the edge's own registry (`/metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer

from services.edge.protocol import DeltaFrame, DoneFrame, ErrorFrame, ServerFrame
from shared import semconv
from shared.kafka import Headers
from shared.messages import BatchRef, QueuedRequest, RequestRecord
from shared.metrics import EdgeRequestMetrics, edge_metrics
from shared.telemetry import extract, has_trace, inject, record_span, sent_at, tracer


class ResultHeaders(Protocol):
    """What telemetry reads of a result record (aiokafka's ConsumerRecord)."""

    @property
    def timestamp(self) -> int: ...

    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


@dataclass(eq=False)
class InFlight:
    """One request's trace and latency clocks, from its frame to its final frame."""

    request_id: str
    root: Span
    context: Context  # the root span's
    tier: str
    started: float
    first_delta: bool = False
    # The latest result record of the request, read at the end for its create time and the
    # trace context it carried (kept as is: most records are not the last).
    last_record: ResultHeaders | None = None
    ended: bool = False  # the root span is ended; nothing more is measured


@dataclass(frozen=True)
class Sending:
    """The producer span of a request record, and the headers that carry it."""

    span: Span
    headers: Headers


@dataclass
class EdgeTelemetry:
    metrics: EdgeRequestMetrics = field(default_factory=edge_metrics)
    tracer: Tracer = field(default_factory=tracer)
    clock: Callable[[], float] = time.time
    # Lag is measured on the shared results topic only: per-request topics would each make
    # a label value of their own.
    results_topic: str | None = None
    # Continue a client's `traceparent` (TOKENBUS_EDGE_TRUST_TRACEPARENT). Off: any client
    # could pick the trace id (and its sampling decision) of what the edge records and
    # sends on, so its trace is kept only as a link of a trace the edge starts.
    trust_traceparent: bool = False

    def begin(
        self,
        request_id: str,
        *,
        tier: str,
        max_tokens: int | None,
        parent: Mapping[str, str] | None = None,
        batch: BatchRef | None = None,
    ) -> InFlight:
        """A request frame was read: open its root span (continuing `parent`'s trace, if any,
        and if trusted; else linked to it)."""
        now = self.clock()
        parent_ctx, links = self._parent(parent)
        attributes: dict[str, Any] = {
            semconv.GEN_AI_OPERATION_NAME: "chat",
            semconv.REQUEST_ID: request_id,
            semconv.TIER: tier,
        }
        if max_tokens is not None:
            attributes[semconv.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
        if batch is not None:  # an OpenAI batch's line: its trace names the batch
            attributes[semconv.OPENAI_BATCH_ID] = batch.batch_id
            attributes[semconv.OPENAI_BATCH_CUSTOM_ID] = batch.custom_id
        root = self.tracer.start_span(
            semconv.SPAN_CHAT,
            context=parent_ctx,
            kind=SpanKind.SERVER,
            attributes=attributes,
            links=links,
            start_time=int(now * 1e9),
        )
        context = trace.set_span_in_context(root, parent_ctx)
        self.metrics.in_flight.inc()
        return InFlight(request_id, root, context, tier, now)

    def _parent(self, carrier: Mapping[str, str] | None) -> tuple[Context, list[Link]]:
        """The context a request's root span starts in, and the links it carries."""
        client = extract(carrier) if carrier else Context()
        if self.trust_traceparent:
            return client, []
        span_context = trace.get_current_span(client).get_span_context()
        return Context(), [Link(span_context)] if span_context.is_valid else []

    def sending(
        self, flight: InFlight, topic: str, record: RequestRecord, queued: QueuedRequest | None
    ) -> Sending:
        """The request record is about to be written: the `accept` stage, and the producer
        span whose context the caller puts in the record's headers. `queued`: the record
        goes straight to its tier topic (ADR 0041), so the `admit` stage, ingest's on the
        other path, is the edge's."""
        record_span(
            semconv.stage_span_name(semconv.STAGE_ACCEPT),
            start=flight.started,
            end=record.created_at,
            context=flight.context,
            attributes={semconv.STAGE: semconv.STAGE_ACCEPT, semconv.REQUEST_ID: flight.request_id},
            tracer_=self.tracer,
        )
        if queued is not None:
            record_span(
                semconv.stage_span_name(semconv.STAGE_ADMIT),
                start=queued.created_at,
                end=queued.accepted_at,
                context=flight.context,
                attributes={
                    semconv.STAGE: semconv.STAGE_ADMIT,
                    semconv.REQUEST_ID: flight.request_id,
                    semconv.TIER: queued.tier.value,
                    semconv.ADMISSION: "direct",
                    semconv.MESSAGING_DESTINATION_NAME: topic,
                },
                tracer_=self.tracer,
            )
        span = self.tracer.start_span(
            semconv.messaging_span_name("send", topic),
            context=flight.context,
            kind=SpanKind.PRODUCER,
            attributes={
                semconv.MESSAGING_SYSTEM: semconv.MESSAGING_SYSTEM_KAFKA,
                semconv.MESSAGING_DESTINATION_NAME: topic,
                semconv.MESSAGING_OPERATION_TYPE: "send",
                semconv.MESSAGING_KAFKA_MESSAGE_KEY: flight.request_id,
                semconv.REQUEST_ID: flight.request_id,
            },
        )
        headers = inject(context=trace.set_span_in_context(span, flight.context))
        return Sending(span, headers)

    def sent(self, flight: InFlight, sending: Sending, error: BaseException | None) -> None:
        """How the write of the request record went; a failure ends the trace."""
        if error is not None:
            sending.span.record_exception(error)
            sending.span.set_status(Status(StatusCode.ERROR))
        sending.span.end()
        if error is not None:
            self._end(flight, outcome="produce_failed", error=type(error).__name__)
        else:
            self.metrics.requests.labels(flight.tier).inc()

    def fetched(self, consumer: Any, fetched: Mapping[Any, Sequence[Any]]) -> None:
        """After a fetch of result records: the lag of the shared results topic."""
        ours = {tp: records for tp, records in fetched.items() if tp.topic == self.results_topic}
        if ours:
            self.metrics.lag.observe(consumer, ours)

    @staticmethod
    def result_record(flight: InFlight, record: ResultHeaders) -> None:
        """A result record of this request was read: kept, and read only if it is the last."""
        flight.last_record = record

    def end(self, flight: InFlight, *, outcome: str) -> None:
        """The request ended without a final frame written (not opened, or let go of)."""
        self._end(flight, outcome=outcome, error=outcome)

    def frame_written(self, flight: InFlight, frame: ServerFrame) -> None:
        """A frame reached the client: the first delta and the final frame are measured."""
        if flight.ended:
            return
        now = self.clock()
        if isinstance(frame, DeltaFrame):
            if not flight.first_delta:
                flight.first_delta = True
                self.metrics.first_delta.labels(flight.tier).observe(now - flight.started)
            return
        if not isinstance(frame, DoneFrame | ErrorFrame):
            return
        if (last := flight.last_record) is not None:
            written_at = sent_at(last.headers, fallback=last.timestamp / 1000)
            carried = extract(last.headers)
            parent = carried if has_trace(carried) else flight.context
            record_span(
                semconv.stage_span_name(semconv.STAGE_DELIVER),
                start=written_at,
                end=now,
                context=parent,
                attributes={
                    semconv.STAGE: semconv.STAGE_DELIVER,
                    semconv.REQUEST_ID: flight.request_id,
                },
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
            if frame.variant is not None:
                flight.root.set_attribute(semconv.VARIANT, frame.variant)
            if frame.model is not None:  # the model that answered (a cascade's: ADR 0059)
                flight.root.set_attribute(semconv.GEN_AI_RESPONSE_MODEL, frame.model)
            self._end(flight, outcome=frame.finish_reason, now=now)
        else:
            self._end(flight, outcome=frame.code.value, error=frame.code.value, now=now)

    def _end(
        self, flight: InFlight, *, outcome: str, error: str | None = None, now: float | None = None
    ) -> None:
        if flight.ended:
            return
        flight.ended = True
        now = self.clock() if now is None else now
        if error is not None:
            flight.root.set_attribute(semconv.ERROR_TYPE, error)
            flight.root.set_status(Status(StatusCode.ERROR))
        flight.root.end(end_time=int(now * 1e9))
        self.metrics.in_flight.dec()
        self.metrics.responses.labels(flight.tier, outcome).inc()
        if outcome != "abandoned":  # a client that went away says nothing about latency
            self.metrics.duration.labels(flight.tier).observe(now - flight.started)
