"""services.edge.telemetry: the root span, the accept and deliver stages, the edge metrics."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from services.edge.protocol import DeltaFrame, DoneFrame, ErrorFrame
from services.edge.telemetry import EdgeTelemetry
from shared import semconv
from shared.messages import ErrorCode, RequestRecord, Timings, Usage
from shared.metrics import EdgeRequestMetrics
from shared.telemetry import extract, span_context_of
from tests.fakes import FakeClock, FakeTopicPartition

WORKER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass(frozen=True)
class FakeRecord:
    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes
    headers: tuple[tuple[str, bytes], ...]


class FakeConsumer:
    def highwater(self, tp: object) -> int | None:
        return None


@pytest.fixture
def setup() -> tuple[EdgeTelemetry, InMemorySpanExporter, CollectorRegistry, FakeClock]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    metrics = EdgeRequestMetrics.build(registry)
    clock = FakeClock()
    tel = EdgeTelemetry(
        metrics=metrics,
        tracer=provider.get_tracer("test"),
        clock=clock,
    )
    return tel, exporter, registry, clock


def record(request_id: str, created_at: float) -> RequestRecord:
    return RequestRecord(request_id=request_id, prompt="hi", created_at=created_at)


def test_a_request_from_frame_to_final_frame(
    setup: tuple[EdgeTelemetry, InMemorySpanExporter, CollectorRegistry, FakeClock],
) -> None:
    tel, exporter, registry, clock = setup
    flight = tel.begin("r1", tier="interactive", max_tokens=8)
    sending = tel.sending(flight, "t.requests", record("r1", 1000.002), None)
    headers = sending.headers  # the caller writes the record with these
    tel.sent(flight, sending, None)
    clock.now = 1000.1
    tel.frame_written(flight, DeltaFrame(request_id="r1", seq=0, text="a"))
    result = FakeRecord("t.results", 0, 7, 1000_250, b"r1", (("traceparent", WORKER.encode()),))
    tel.fetched(FakeConsumer(), {FakeTopicPartition("t.results", 0): [result]})
    tel.result_record(flight, result)
    clock.now = 1000.3
    tel.frame_written(
        flight,
        DoneFrame(
            request_id="r1",
            finish_reason="length",
            usage=Usage(prompt_tokens=1, completion_tokens=8),
            timings=Timings(queue_ms=1, batch_size=1, ttft_ms=2, total_ms=3),
        ),
    )
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, accept, send, deliver = (
        spans["chat"],
        spans["stage accept"],
        spans["send t.requests"],
        spans["stage deliver"],
    )
    assert root.start_time == 1000_000_000_000
    assert root.end_time == 1000_300_000_000
    assert root.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 8
    assert accept.parent.span_id == root.context.span_id  # type: ignore[union-attr]
    assert accept.end_time == 1000_002_000_000
    # The record carries the producer span; the deliver stage continues the worker's span.
    assert span_context_of(extract(headers)).span_id == send.context.span_id
    assert deliver.parent.span_id == 0x00F067AA0BA902B7  # type: ignore[union-attr]
    assert deliver.start_time == 1000_250_000_000
    assert deliver.end_time == 1000_300_000_000
    t = {"tier": "interactive"}
    assert registry.get_sample_value("tokenbus_edge_requests_total", t) == 1
    assert (
        registry.get_sample_value(
            "tokenbus_edge_responses_total", {"tier": "interactive", "outcome": "length"}
        )
        == 1
    )
    assert registry.get_sample_value(
        "tokenbus_edge_request_duration_seconds_sum", t
    ) == pytest.approx(0.3)
    assert registry.get_sample_value(
        "tokenbus_edge_time_to_first_delta_seconds_sum", t
    ) == pytest.approx(0.1)
    assert registry.get_sample_value("tokenbus_edge_delivery_seconds_sum", t) == pytest.approx(0.05)
    assert registry.get_sample_value("tokenbus_edge_requests_in_flight", {}) == 0
    assert flight.ended


@pytest.mark.parametrize("variant", ["canary", None])
def test_the_root_span_names_the_variant_that_answered(
    setup: tuple[EdgeTelemetry, InMemorySpanExporter, CollectorRegistry, FakeClock],
    variant: str | None,
) -> None:
    tel, exporter, _, _ = setup
    flight = tel.begin("r1", tier="interactive", max_tokens=8)
    tel.frame_written(
        flight,
        DoneFrame(
            request_id="r1",
            finish_reason="stop",
            usage=Usage(prompt_tokens=1, completion_tokens=1),
            timings=Timings(queue_ms=1, batch_size=1, ttft_ms=2, total_ms=3),
            variant=variant,
        ),
    )
    [root] = [s for s in exporter.get_finished_spans() if s.name == "chat"]
    assert root.attributes is not None
    assert root.attributes.get(semconv.VARIANT) == variant


def test_a_failed_produce_ends_the_trace_with_an_error(
    setup: tuple[EdgeTelemetry, InMemorySpanExporter, CollectorRegistry, FakeClock],
) -> None:
    tel, exporter, registry, _ = setup
    flight = tel.begin("r1", tier="interactive", max_tokens=None)
    sending = tel.sending(flight, "t.requests", record("r1", 1000.0), None)
    tel.sent(flight, sending, ConnectionError("broker gone"))
    root = next(s for s in exporter.get_finished_spans() if s.name == "chat")
    send = next(s for s in exporter.get_finished_spans() if s.name == "send t.requests")
    assert not root.status.is_ok
    assert not send.status.is_ok
    assert registry.get_sample_value("tokenbus_edge_requests_in_flight", {}) == 0
    assert (
        registry.get_sample_value(
            "tokenbus_edge_responses_total", {"tier": "interactive", "outcome": "produce_failed"}
        )
        == 1
    )


def test_an_error_frame_ends_the_request_and_continues_the_parent(
    setup: tuple[EdgeTelemetry, InMemorySpanExporter, CollectorRegistry, FakeClock],
) -> None:
    tel, exporter, _, _ = setup
    tel.trust_traceparent = True  # TOKENBUS_EDGE_TRUST_TRACEPARENT=true
    flight = tel.begin("r1", tier="background", max_tokens=4, parent={"traceparent": WORKER})
    error = ErrorFrame(code=ErrorCode.deadline_exceeded, message="late", request_id="r1")
    tel.frame_written(flight, error)
    (root,) = exporter.get_finished_spans()
    assert root.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert root.attributes[semconv.ERROR_TYPE] == "deadline_exceeded"
    # A frame after the final one measures nothing more.
    tel.frame_written(flight, error)
    assert len(exporter.get_finished_spans()) == 1


def test_an_untrusted_callers_traceparent_is_only_linked(
    setup: tuple[EdgeTelemetry, InMemorySpanExporter, CollectorRegistry, FakeClock],
) -> None:
    """By default a client cannot choose the edge's trace: a new one, linked to the client's."""
    tel, exporter, _, _ = setup
    flight = tel.begin("r1", tier="interactive", max_tokens=4, parent={"traceparent": WORKER})
    tel.frame_written(flight, ErrorFrame(code=ErrorCode.cancelled, message="x", request_id="r1"))
    (root,) = exporter.get_finished_spans()
    assert root.context.trace_id != 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert root.parent is None
    (link,) = root.links
    assert link.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
