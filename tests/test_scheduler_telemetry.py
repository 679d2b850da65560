"""services.scheduler.telemetry: each request's stages, the batch span and its links, metrics."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from services.scheduler.telemetry import SchedulerTelemetry
from shared import semconv
from shared.messages import Tier
from shared.metrics import SchedulerMetrics
from shared.telemetry import extract, span_context_of
from tests.factories import queued_request

PARENTS = [
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
]


def test_batch_span_links_every_request_and_requests_carry_their_own_trace() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    metrics = SchedulerMetrics.build(registry)
    tel = SchedulerTelemetry(
        "t.batches",
        {Tier.interactive: 4},
        metrics=metrics,
        tracer=provider.get_tracer("test"),
    )
    requests = [
        queued_request(f"r{i}", accepted_at=100.0 + i).model_copy(
            update={"trace": {"traceparent": p}}
        )
        for i, p in enumerate(PARENTS)
    ]
    for request in requests:
        tel.arrived(request)
    assert registry.get_sample_value("tokenbus_tier_queue_depth", {"tier": "interactive"}) == 2
    trace = tel.batch_formed(batch_id="b1", tier=Tier.interactive, reason="timeout",
                             requests=requests, departed_at=110.0, formed_at=110.5)  # fmt: skip
    tel.batch_sent("b1")
    headers = trace.headers
    # What the worker gets: each request with the trace context telemetry returned for it.
    sent = [
        r.model_copy(update={"trace": t})
        for r, t in zip(requests, trace.request_traces, strict=True)
    ]
    assert [r.trace for r in requests] == [{"traceparent": p} for p in PARENTS]  # not rewritten

    spans = exporter.get_finished_spans()
    stages = [s for s in spans if s.attributes and semconv.STAGE in s.attributes]
    assert len(stages) == 4
    for request, parent in zip(sent, PARENTS, strict=True):
        # Both stages continue the request's own trace.
        mine = [s for s in stages if s.attributes[semconv.REQUEST_ID] == request.request_id]
        assert {s.context.trace_id for s in mine} == {int(parent.split("-")[1], 16)}
        wait = next(s for s in mine if s.attributes[semconv.STAGE] == "queue_wait")
        form = next(s for s in mine if s.attributes[semconv.STAGE] == "batch_form")
        assert wait.end_time == form.start_time == 110_000_000_000
        assert form.end_time == 110_500_000_000
        # What the worker gets: the batch_form span as the request's parent.
        assert span_context_of(extract(request.trace)).span_id == form.context.span_id

    (batch_span,) = [s for s in spans if s.name == "send t.batches"]
    assert batch_span.parent is None
    linked = {link.context.span_id for link in batch_span.links}
    assert linked == {
        s.context.span_id for s in stages if s.attributes[semconv.STAGE] == "batch_form"
    }
    assert batch_span.attributes[semconv.MESSAGING_BATCH_MESSAGE_COUNT] == 2
    assert span_context_of(extract(headers)).span_id == batch_span.context.span_id

    t = {"tier": "interactive"}
    assert registry.get_sample_value("tokenbus_tier_queue_depth", t) == 0
    assert registry.get_sample_value("tokenbus_batch_size_sum", t) == 2
    assert registry.get_sample_value("tokenbus_batch_fill_ratio_sum", t) == 0.5
    assert registry.get_sample_value("tokenbus_tier_queue_wait_seconds_sum", t) == 10.0 + 9.0
    assert (
        registry.get_sample_value(
            "tokenbus_batches_total", {"tier": "interactive", "reason": "timeout"}
        )
        == 1
    )


def test_expired_requests_leave_the_queue_depth() -> None:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics.build(registry)
    tel = SchedulerTelemetry("t.batches", {Tier.interactive: 4}, metrics=metrics)
    request = queued_request("r1", accepted_at=1.0)
    tel.arrived(request)
    tel.expired(request)
    t = {"tier": "interactive"}
    assert registry.get_sample_value("tokenbus_tier_queue_depth", t) == 0
    assert registry.get_sample_value("tokenbus_scheduler_expired_total", t) == 1


def test_the_queue_depth_per_model_drops_to_zero_rather_than_vanishing() -> None:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics.build(registry)
    tel = SchedulerTelemetry("t.batches", {Tier.interactive: 4}, metrics=metrics)

    def depth(model: str) -> float | None:
        return registry.get_sample_value("tokenbus_model_queue_depth", {"model": model})

    tel.waiting_by_model({"big": 3, None: 1})
    assert (depth("big"), depth(""), depth("small")) == (3, 1, None)
    tel.waiting_by_model({"small": 2})
    assert (depth("big"), depth(""), depth("small")) == (0, 0, 2)
