"""shared.telemetry: W3C context on Kafka headers, the JSON-lines exporter, exporter choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link

from shared import semconv
from shared.telemetry import (
    JsonLinesSpanExporter,
    TelemetrySettings,
    add_trace_ids,
    carrier,
    context_from,
    extract,
    has_trace,
    head_sampler,
    inject,
    make_exporter,
    read_span_file,
    record_span,
    service_resource,
    span_context_of,
)
from tests.stack import ROOT

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def local_tracer(exporter: object) -> trace.Tracer:
    provider = TracerProvider(resource=service_resource("test"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # type: ignore[arg-type]
    return provider.get_tracer("test")


def test_extract_reads_aiokafka_headers() -> None:
    ctx = extract([("traceparent", TRACEPARENT.encode()), ("other", b"x")])
    sc = span_context_of(ctx)
    assert format(sc.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert format(sc.span_id, "016x") == "00f067aa0ba902b7"
    assert sc.is_remote


def test_extract_of_nothing_is_an_empty_context() -> None:
    assert not has_trace(extract(None))
    assert not has_trace(extract([]))
    assert not has_trace(extract([("traceparent", b"garbage")]))


def test_inject_replaces_trace_headers_and_keeps_the_rest() -> None:
    ctx = context_from({"traceparent": TRACEPARENT})
    headers = [("traceparent", b"00-old-old-01"), ("tokenbus-x", b"1")]
    out = inject(headers, context=ctx)
    assert out is headers
    assert ("tokenbus-x", b"1") in out
    assert [v for k, v in out if k == "traceparent"] == [TRACEPARENT.encode()]


def test_inject_without_a_trace_adds_nothing() -> None:
    assert inject(context=Context()) == []


def test_round_trip_through_headers_and_carrier() -> None:
    exporter = InMemorySpanExporter()
    tracer = local_tracer(exporter)
    with tracer.start_as_current_span("producer") as span:
        headers = inject()
        as_dict = carrier()
    sent = span.get_span_context()
    assert span_context_of(extract(headers)).span_id == sent.span_id
    assert span_context_of(context_from(as_dict)).trace_id == sent.trace_id


def test_record_span_uses_the_given_times_and_parent() -> None:
    exporter = InMemorySpanExporter()
    tracer = local_tracer(exporter)
    parent = context_from({"traceparent": TRACEPARENT})
    child = record_span(
        "stage x", start=100.25, end=100.5, context=parent, attributes={"a": 1}, tracer_=tracer
    )
    (span,) = exporter.get_finished_spans()
    assert span.start_time == 100_250_000_000
    assert span.end_time == 100_500_000_000
    assert span.parent is not None
    assert format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert span_context_of(child).span_id == span.context.span_id


def sampled_tracer(exporter: InMemorySpanExporter, ratio: float) -> trace.Tracer:
    provider = TracerProvider(resource=service_resource("test"), sampler=head_sampler(ratio))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test")


def test_head_sampling_keeps_the_ratio_of_new_traces() -> None:
    kept, dropped = InMemorySpanExporter(), InMemorySpanExporter()
    for _ in range(50):
        record_span("a", start=1.0, end=2.0, context=None, tracer_=sampled_tracer(kept, 1.0))
        record_span("a", start=1.0, end=2.0, context=None, tracer_=sampled_tracer(dropped, 0.0))
    assert len(kept.get_finished_spans()) == 50
    assert dropped.get_finished_spans() == ()
    some = InMemorySpanExporter()
    tracer = sampled_tracer(some, 0.25)
    for _ in range(2000):
        record_span("a", start=1.0, end=2.0, context=None, tracer_=tracer)
    assert 300 < len(some.get_finished_spans()) < 700  # 500 expected; binomial sd ~19


def test_a_later_span_follows_its_traces_first_so_a_trace_is_whole() -> None:
    """A service downstream keeps what the edge kept and drops what it dropped, whatever
    its own ratio: the decision travels in the traceparent's sampled flag."""
    exporter = InMemorySpanExporter()
    kept_parent = context_from({"traceparent": TRACEPARENT})  # flags 01: sampled
    dropped_parent = context_from({"traceparent": TRACEPARENT[:-2] + "00"})
    first = record_span(
        "ingest", start=1.0, end=2.0, context=kept_parent, tracer_=sampled_tracer(exporter, 0.0)
    )
    record_span("worker", start=2.0, end=3.0, context=first, tracer_=sampled_tracer(exporter, 0.0))
    record_span(
        "ingest", start=1.0, end=2.0, context=dropped_parent, tracer_=sampled_tracer(exporter, 1.0)
    )
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["ingest", "worker"]
    assert {format(s.context.trace_id, "032x") for s in spans} == {
        "4bf92f3577b34da6a3ce929d0e0e4736"
    }
    # The dropped trace still passes its context on, flag and all, so it stays dropped.
    dropped_child = record_span(
        "x", start=1.0, end=2.0, context=dropped_parent, tracer_=sampled_tracer(exporter, 1.0)
    )
    assert carrier(dropped_child)["traceparent"].endswith("-00")


def test_record_span_never_ends_before_it_starts() -> None:
    exporter = InMemorySpanExporter()
    record_span("x", start=5.0, end=4.0, context=None, tracer_=local_tracer(exporter))
    (span,) = exporter.get_finished_spans()
    assert span.end_time == span.start_time


def test_json_lines_exporter_writes_spans_that_read_back(tmp_path: Path) -> None:
    exporter = JsonLinesSpanExporter(tmp_path, "worker")
    tracer = local_tracer(exporter)
    linked = span_context_of(context_from({"traceparent": TRACEPARENT}))
    with (
        tracer.start_as_current_span("parent", attributes={semconv.TIER: "interactive"}),
        tracer.start_as_current_span(
            "child", links=[Link(linked)], attributes={"reasons": ("stop",)}
        ),
    ):
        pass
    exporter.shutdown()
    # A writer killed mid-line leaves a torn last line; readers skip it.
    with exporter.path.open("a") as f:
        f.write('{"trace_id": "tor')
    child, parent = list(read_span_file(exporter.path))
    assert exporter.path.name.startswith("worker-")
    assert child.parent_span_id == parent.span_id
    assert parent.parent_span_id is None
    assert child.trace_id == parent.trace_id
    assert child.service == "tokenbus-test"
    assert child.links[0].span_id == "00f067aa0ba902b7"
    assert child.attributes == {"reasons": ["stop"]}
    assert parent.attributes[semconv.TIER] == "interactive"
    assert child.end_ns >= child.start_ns > 0
    json.loads(exporter.path.read_text().splitlines()[0])  # plain JSON, one span a line


def test_exporter_choice(tmp_path: Path) -> None:
    assert make_exporter("edge", TelemetrySettings()) is None
    to_dir = make_exporter("edge", TelemetrySettings(trace_dir=tmp_path))
    assert isinstance(to_dir, JsonLinesSpanExporter)
    to_dir.shutdown()
    otlp = TelemetrySettings(trace_dir=tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1")
    assert isinstance(make_exporter("edge", otlp), OTLPSpanExporter)
    off = TelemetrySettings(trace_dir=tmp_path, OTEL_SDK_DISABLED=True)
    assert make_exporter("edge", off) is None


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENBUS_TRACE_DIR", "/tmp/x")
    monkeypatch.setenv("TOKENBUS_METRICS_PORT", "9464")
    monkeypatch.setenv("TOKENBUS_TRACE_SAMPLE_RATIO", "0.05")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318")
    s = TelemetrySettings()
    assert (str(s.trace_dir), s.metrics_port, s.otlp_endpoint, s.trace_sample_ratio) == (
        "/tmp/x",
        9464,
        "http://jaeger:4318",
        0.05,
    )


def test_log_lines_carry_the_trace_id_inside_a_span() -> None:
    tracer = local_tracer(InMemorySpanExporter())
    assert add_trace_ids(None, "info", {"event": "x"}) == {"event": "x"}
    with tracer.start_as_current_span("s") as span:
        line = add_trace_ids(None, "info", {"event": "x"})
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert line["span_id"] == format(span.get_span_context().span_id, "016x")


class FakeCollector(BaseHTTPRequestHandler):
    """A fake OTLP/HTTP collector: keeps every POSTed trace export."""

    received: list[tuple[str, bytes]] = []  # noqa: RUF012

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        FakeCollector.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.integration
def test_otlp_endpoint_gets_the_spans() -> None:
    server = HTTPServer(("127.0.0.1", 0), FakeCollector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeCollector.received.clear()
    # A child process: setting the global tracer provider is once per process.
    code = (
        "from shared.telemetry import setup_tracing, record_span\n"
        "provider = setup_tracing('worker')\n"
        "record_span('stage decode', start=1.0, end=2.0, context=None)\n"
        "provider.shutdown()\n"
    )
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        "NO_PROXY": "127.0.0.1",
    }
    try:
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60, cwd=ROOT)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    (path, body), *_ = FakeCollector.received
    assert path == "/v1/traces"
    export = ExportTraceServiceRequest.FromString(body)
    resource = export.resource_spans[0]
    names = {a.value.string_value for a in resource.resource.attributes if a.key == "service.name"}
    assert names == {"tokenbus-worker"}
    assert [s.name for s in resource.scope_spans[0].spans] == ["stage decode"]
