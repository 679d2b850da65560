"""tokenbus.waterfall: a request's spans in parent order, its stages, the slowest requests."""

from __future__ import annotations

from shared import semconv
from shared.telemetry import LinkRecord, SpanRecord
from tokenbus import waterfall

T = "a" * 32
BATCH_T = "b" * 32
MS = 1_000_000


def span(
    span_id: str,
    name: str,
    service: str,
    start_ms: float,
    end_ms: float,
    parent: str | None = None,
    trace_id: str = T,
    stage: str | None = None,
    kind: str = "INTERNAL",
    links: list[LinkRecord] | None = None,
    **attributes: object,
) -> SpanRecord:
    attrs: dict[str, object] = {semconv.REQUEST_ID: "r1", **attributes} if trace_id == T else {}
    if stage:
        attrs[semconv.STAGE] = stage
    return SpanRecord(
        trace_id=trace_id,
        span_id=span_id.rjust(16, "0"),
        parent_span_id=parent.rjust(16, "0") if parent else None,
        name=name,
        kind=kind,
        service=f"tokenbus-{service}",
        start_ns=int(start_ms * MS),
        end_ns=int(end_ms * MS),
        attributes=attrs,
        links=links or [],
    )


def request_spans() -> list[SpanRecord]:
    """One request as the services record it: stages tile 0..100 ms."""
    return [
        span("1", "chat", "edge", 0, 100, kind="SERVER", **{semconv.TIER: "interactive"}),
        span("2", "stage accept", "edge", 0, 1, "1", stage="accept"),
        span("3", "send t.requests", "edge", 1, 3, "1", kind="PRODUCER"),
        span("4", "stage admit", "ingest", 1, 4, "3", stage="admit"),
        span("5", "t.requests process", "ingest", 2, 5, "3", kind="CONSUMER"),
        span("6", "t.requests.interactive publish", "ingest", 4, 5, "5", kind="PRODUCER"),
        span("7", "stage queue_wait", "scheduler", 4, 20, "6", stage="queue_wait"),
        span("8", "stage batch_form", "scheduler", 20, 21, "6", stage="batch_form"),
        span("9", "stage batch_transit", "worker", 21, 23, "8", stage="batch_transit"),
        span("a", "worker.request", "worker", 23, 95, "8", kind="CONSUMER"),
        span("b", "stage prefill", "worker", 23, 30, "a", stage="prefill"),
        span("c", "stage decode", "worker", 30, 90, "a", stage="decode"),
        span("d", "stage result_publish", "worker", 90, 94, "a", stage="result_publish"),
        span("e", "stage deliver", "edge", 94, 100, "a", stage="deliver"),
        # The batch's own trace, linked to the request's batch_form span.
        span(
            "f",
            "send t.batches",
            "scheduler",
            20,
            22,
            trace_id=BATCH_T,
            kind="PRODUCER",
            links=[LinkRecord(trace_id=T, span_id="8".rjust(16, "0"))],
        ),
        span("10", "receive t.batches", "worker", 22, 22, "f", trace_id=BATCH_T, kind="CONSUMER"),
        # Another request's trace: not shown.
        span("11", "chat", "edge", 0, 10, trace_id="c" * 32, kind="SERVER"),
    ]


def test_waterfall_orders_spans_by_parent_then_start() -> None:
    w = waterfall.build("r1", request_spans())
    assert w is not None
    names = [(r.depth, r.span.name) for r in w.rows if not r.linked]
    assert names[:4] == [
        (0, "chat"),
        (1, "stage accept"),
        (1, "send t.requests"),
        (2, "stage admit"),
    ]
    assert (4, "stage queue_wait") in names
    assert (6, "stage prefill") in names
    linked = [r.span.name for r in w.rows if r.linked]
    assert linked == ["send t.batches", "receive t.batches"]
    assert all(r.span.trace_id != "c" * 32 for r in w.rows)


def test_stages_tile_the_request_and_add_up_to_its_time() -> None:
    w = waterfall.build("r1", request_spans())
    assert w is not None
    assert list(w.stages) == list(semconv.STAGES)
    assert w.total_ms == 100.0
    assert w.stage_total_ms == 100.0
    assert w.stages["decode"] == 60.0


def test_render_shows_services_offsets_durations_and_the_stage_sum() -> None:
    w = waterfall.build("r1", request_spans())
    assert w is not None
    text = waterfall.render(w)
    assert "request r1" in text
    assert T in text
    line = next(x for x in text.splitlines() if "stage queue_wait" in x)
    assert line.split()[0] == "scheduler"
    assert "4.000" in line
    assert "16.000" in line
    assert "stage=queue_wait" in line
    assert "linked (the batch this request rode):" in text
    assert "unaccounted 0.000 ms" in text


def test_json_form_carries_every_span() -> None:
    w = waterfall.build("r1", request_spans())
    assert w is not None
    data = w.as_json()
    assert data["stage_total_ms"] == 100.0
    assert len(data["spans"]) == 16
    assert {s["service"] for s in data["spans"]} == {"edge", "ingest", "scheduler", "worker"}


def test_unknown_request_has_no_waterfall() -> None:
    assert waterfall.build("nope", request_spans()) is None


def test_slowest_lists_requests_by_end_to_end_time() -> None:
    spans = request_spans()
    spans.append(span("12", "chat", "edge", 0, 300, kind="SERVER", trace_id="d" * 32))
    spans[-1].attributes[semconv.REQUEST_ID] = "r2"
    rows = waterfall.slowest(spans, 1)
    assert [(r.request_id, r.total_ms) for r in rows] == [("r2", 300.0)]
    both = waterfall.slowest(spans, 5)
    assert [r.request_id for r in both] == ["r2", "r1"]
    assert both[1].slowest_stage == "decode"
    assert both[1].tier == "interactive"
    assert "r2" in waterfall.render_slowest(both).splitlines()[2]
