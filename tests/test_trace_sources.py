"""tokenbus.trace_sources and `tokenbus trace`: spans from JSON-lines files and from Jaeger."""

from __future__ import annotations

import base64
import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from shared import semconv
from tests.test_waterfall import BATCH_T, T, request_spans
from tokenbus.cli import main
from tokenbus.trace_sources import JaegerSource, JsonLinesSource, otlp_spans


def write_spans(directory: Path) -> None:
    spans = request_spans()
    by_service: dict[str, list[str]] = {}
    for s in spans:
        by_service.setdefault(s.service, []).append(s.model_dump_json())
    for service, lines in by_service.items():
        (directory / f"{service}-1.jsonl").write_text("\n".join(lines) + "\n")


def test_json_lines_source_finds_the_request_and_its_batch(tmp_path: Path) -> None:
    write_spans(tmp_path)
    spans = JsonLinesSource(tmp_path).request_spans("r1")
    assert {s.trace_id for s in spans} == {T, BATCH_T}
    assert len(spans) == 16
    assert JsonLinesSource(tmp_path).request_spans("missing") == []


def test_cli_prints_the_waterfall(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_spans(tmp_path)
    assert main(["trace", "r1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for service in ("edge", "ingest", "scheduler", "worker"):
        assert f"\n{service} " in out
    assert "unaccounted 0.000 ms" in out


def test_cli_json_and_slowest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_spans(tmp_path)
    assert main(["trace", "r1", "--dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stage_total_ms"] == 100.0
    assert main(["trace", "--slowest", "3", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "r1" in out
    assert "decode" in out


def test_cli_says_plainly_when_nothing_is_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", "nope", "--dir", str(tmp_path)]) == 1
    assert "no spans name request nope" in capsys.readouterr().err
    assert main(["trace", "--dir", str(tmp_path)]) == 2


def otlp_answer() -> dict[str, Any]:
    """What Jaeger's API v3 returns for the request trace: OTLP JSON under `result`."""

    def attr(key: str, value: str) -> dict[str, Any]:
        return {"key": key, "value": {"stringValue": value}}

    def resource(service: str, spans: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "resource": {"attributes": [attr("service.name", service)]},
            "scopeSpans": [{"scope": {"name": "tokenbus"}, "spans": spans}],
        }

    return {
        "result": {
            "resourceSpans": [
                resource(
                    "tokenbus-edge",
                    [
                        {
                            "traceId": T,
                            "spanId": "0000000000000001",
                            "name": "chat",
                            "kind": "SPAN_KIND_SERVER",
                            "startTimeUnixNano": "1000000000",
                            "endTimeUnixNano": "1050000000",
                            "attributes": [attr(semconv.REQUEST_ID, "r1")],
                            "status": {},
                        }
                    ],
                ),
                resource(
                    "tokenbus-worker",
                    [
                        {
                            "traceId": T,
                            "spanId": "0000000000000002",
                            "parentSpanId": "0000000000000001",
                            "name": "stage decode",
                            "kind": 1,
                            "startTimeUnixNano": "1010000000",
                            "endTimeUnixNano": "1050000000",
                            "attributes": [
                                attr(semconv.STAGE, "decode"),
                                attr(semconv.REQUEST_ID, "r1"),
                                {"key": "tokens", "value": {"intValue": "7"}},
                            ],
                            "links": [{"traceId": BATCH_T, "spanId": "00000000000000aa"}],
                            "status": {"code": "STATUS_CODE_ERROR"},
                        }
                    ],
                ),
            ]
        }
    }


def batch_answer() -> dict[str, Any]:
    span = {
        "traceId": base64.b64encode(bytes.fromhex(BATCH_T)).decode(),
        "spanId": base64.b64encode(bytes.fromhex("00000000000000aa")).decode(),
        "name": "send tokenbus.batches",
        "kind": "SPAN_KIND_PRODUCER",
        "startTimeUnixNano": "1005000000",
        "endTimeUnixNano": "1006000000",
    }
    return {
        "result": {
            "resourceSpans": [
                {
                    "resource": {
                        "attributes": [
                            {"key": "service.name", "value": {"stringValue": "tokenbus-scheduler"}}
                        ]
                    },
                    "scopeSpans": [{"spans": [span]}],
                }
            ]
        }
    }


def test_otlp_answer_becomes_span_records() -> None:
    root, decode = otlp_spans(otlp_answer())
    assert root.span_id == "0000000000000001"
    assert (root.kind, root.service, root.duration_ms) == ("SERVER", "tokenbus-edge", 50.0)
    assert decode.parent_span_id == root.span_id
    assert (decode.kind, decode.stage, decode.status) == ("INTERNAL", "decode", "ERROR")
    assert decode.attributes["tokens"] == 7
    assert [(link.trace_id, link.span_id) for link in decode.links] == [
        (BATCH_T, "00000000000000aa")
    ]
    [batch] = otlp_spans(batch_answer())  # ids as base64 (protobuf JSON of bytes)
    assert (batch.trace_id, batch.span_id, batch.kind) == (BATCH_T, "00000000000000aa", "PRODUCER")


class FakeJaeger(BaseHTTPRequestHandler):
    """A fake Jaeger query API v3: the edge's search and one trace by id; records what was
    asked. Anything else is v3's 404 for "no traces"."""

    asked: list[str] = []  # noqa: RUF012

    def do_GET(self) -> None:
        FakeJaeger.asked.append(self.path)
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/api/v3/traces" and query["query.service_name"] == ["tokenbus-edge"]:
            answer: dict[str, Any] | None = otlp_answer()
        elif url.path == f"/api/v3/traces/{BATCH_T}":
            answer = batch_answer()
        else:
            answer = None
        self.send_response(200 if answer else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(answer or {"error": {"httpCode": 404}}).encode())

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def fake_jaeger() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), FakeJaeger)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_jaeger_source_finds_the_request_and_its_batch_with_api_v3(fake_jaeger: str) -> None:
    FakeJaeger.asked.clear()
    spans = JaegerSource(fake_jaeger).request_spans("r1")
    assert [s.name for s in spans] == ["chat", "stage decode", "send tokenbus.batches"]
    search = urllib.parse.parse_qs(urllib.parse.urlsplit(FakeJaeger.asked[0]).query)
    assert search["query.service_name"] == ["tokenbus-edge"]
    assert {"query.start_time_min", "query.start_time_max"} <= set(search)
    assert FakeJaeger.asked[1] == f"/api/v3/traces/{BATCH_T}"
    assert JaegerSource(fake_jaeger).request_spans("r2") == []


def test_cli_reads_from_jaeger(fake_jaeger: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "r1", "--jaeger", fake_jaeger]) == 0
    out = capsys.readouterr().out
    assert "stage decode" in out
    assert "worker" in out


def test_jaegers_own_v3_answer_shape_is_read() -> None:
    """The shape of Jaeger v1.76's FindTraces snapshot (cmd/query/app/apiv3/snapshots):
    kind and status as numbers, zero fields left out."""
    body = {
        "result": {
            "resourceSpans": [
                {
                    "resource": {},
                    "scopeSpans": [
                        {
                            "scope": {},
                            "spans": [
                                {
                                    "kind": 2,
                                    "name": "foobar",
                                    "spanId": "0000000000000002",
                                    "status": {"code": 2},
                                    "traceId": "00000000000000000000000000000001",
                                }
                            ],
                        }
                    ],
                }
            ]
        }
    }
    [span] = otlp_spans(body)
    assert (span.kind, span.status, span.service, span.start_ns) == (
        "SERVER",
        "ERROR",
        "unknown",
        0,
    )
    assert span.trace_id == "00000000000000000000000000000001"
