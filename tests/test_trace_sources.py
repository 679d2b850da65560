"""tokenbus.trace_sources and `tokenbus trace`: spans from JSON-lines files and from Jaeger."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from shared import semconv
from tests.test_waterfall import BATCH_T, T, request_spans
from tokenbus.cli import main
from tokenbus.trace_sources import JaegerSource, JsonLinesSource, jaeger_spans


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


def jaeger_answer() -> dict[str, Any]:
    """What Jaeger's /api/traces returns for the request trace (ids without leading zeros)."""
    return {
        "data": [
            {
                "traceID": T,
                "spans": [
                    {
                        "traceID": T,
                        "spanID": "1",
                        "operationName": "chat",
                        "references": [],
                        "startTime": 1_000_000,
                        "duration": 50_000,
                        "tags": [
                            {"key": "span.kind", "type": "string", "value": "server"},
                            {"key": semconv.REQUEST_ID, "type": "string", "value": "r1"},
                        ],
                        "processID": "p1",
                    },
                    {
                        "traceID": T,
                        "spanID": "2",
                        "operationName": "stage decode",
                        "references": [{"refType": "CHILD_OF", "traceID": T, "spanID": "1"}],
                        "startTime": 1_010_000,
                        "duration": 40_000,
                        "tags": [
                            {"key": semconv.STAGE, "type": "string", "value": "decode"},
                            {"key": semconv.REQUEST_ID, "type": "string", "value": "r1"},
                        ],
                        "processID": "p2",
                    },
                ],
                "processes": {
                    "p1": {"serviceName": "tokenbus-edge"},
                    "p2": {"serviceName": "tokenbus-worker"},
                },
            }
        ]
    }


def test_jaeger_answer_becomes_span_records() -> None:
    root, decode = jaeger_spans(jaeger_answer())
    assert root.span_id == "0000000000000001"
    assert root.kind == "SERVER"
    assert root.service == "tokenbus-edge"
    assert root.duration_ms == 50.0
    assert decode.parent_span_id == root.span_id
    assert decode.stage == "decode"


class FakeJaeger(BaseHTTPRequestHandler):
    """A fake Jaeger query API: answers the request search, records what was asked."""

    asked: list[str] = []  # noqa: RUF012

    def do_GET(self) -> None:
        FakeJaeger.asked.append(self.path)
        body = json.dumps(jaeger_answer() if "tokenbus-edge" in self.path else {"data": []})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

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


def test_jaeger_source_searches_by_request_id(fake_jaeger: str) -> None:
    FakeJaeger.asked.clear()
    spans = JaegerSource(fake_jaeger).request_spans("r1")
    assert len(spans) == 2
    assert "service=tokenbus-edge" in FakeJaeger.asked[0]
    assert "tokenbus.request.id" in FakeJaeger.asked[0].replace("%22", "").replace("%2E", ".")


def test_cli_reads_from_jaeger(fake_jaeger: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "r1", "--jaeger", fake_jaeger]) == 0
    out = capsys.readouterr().out
    assert "stage decode" in out
    assert "worker" in out
