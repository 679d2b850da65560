"""Traces in a real Jaeger: the four services export OTLP to it, `tokenbus trace --jaeger`
reads the request back through Jaeger's query API v3.

Jaeger is built from the Go module proxy (tests/tools.py, deploy/jaeger/build.sh; minutes
the first time, cached after) and run from the binary on free ports, memory storage.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import websockets

from shared import semconv
from tests.chat_client import run_requests
from tests.stack import Stack, free_port, new_prefix, wait_until
from tests.tools import jaeger as jaeger_binary
from tokenbus import waterfall
from tokenbus.cli import main
from tokenbus.trace_sources import JaegerSource

CONFIG = """
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:{health}
    grpc:
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{grpc}
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 10000
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp}
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


@dataclass
class Jaeger:
    query_url: str
    otlp_url: str


def answers(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    binary = jaeger_binary()
    home = tmp_path_factory.mktemp("jaeger")
    ports = {name: free_port() for name in ("health", "query", "grpc", "otlp")}
    config = home / "config.yaml"
    config.write_text(CONFIG.format(**ports))
    with open(home / "jaeger.log", "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def up() -> bool:
            assert proc.poll() is None, (home / "jaeger.log").read_text()[-3000:]
            return answers(f"http://127.0.0.1:{ports['health']}/status")

        wait_until(up, 120, "Jaeger's health check", interval=0.2)
        yield Jaeger(f"http://127.0.0.1:{ports['query']}", f"http://127.0.0.1:{ports['otlp']}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def exporting_stack(jaeger: Jaeger, bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_url,
            "TOKENBUS_TRACE_FLUSH_MS": "50",
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": "100",
        },
    )
    try:
        yield stack.start()
    finally:
        stack.stop()


async def ask(stack: Stack) -> str:
    async with websockets.connect(stack.ws_url) as ws:
        transcripts = await run_requests(
            ws, [{"client_id": "c", "prompt": "trace me in jaeger", "max_tokens": 8}]
        )
    t = transcripts["c"]
    assert t.final is not None
    assert t.final["type"] == "chat.done", t.final
    assert t.request_id is not None
    return t.request_id


def trace_cli(request_id: str, url: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["trace", request_id, "--jaeger", url, "--json"]) == 0
    found: dict[str, Any] = json.loads(out.getvalue())
    return found


async def test_tokenbus_trace_reads_the_whole_request_back_from_jaeger(
    exporting_stack: Stack, jaeger: Jaeger
) -> None:
    stack = exporting_stack
    request_id = await ask(stack)
    source = JaegerSource(jaeger.query_url)
    batches_span = f"send {stack.topics.batches}"

    def whole() -> bool:
        # Spans reach Jaeger in batches from three processes: wait for the last of them.
        found = waterfall.build(request_id, source.request_spans(request_id))
        if found is None:
            return False
        names = {r.span.name for r in found.rows}
        return {semconv.SPAN_CHAT, "stage deliver", batches_span} <= names and list(
            found.stages
        ) == list(semconv.STAGES)

    wait_until(whole, 60, f"request {request_id}'s trace in Jaeger", interval=0.5)

    shown = trace_cli(request_id, jaeger.query_url)
    own = [s for s in shown["spans"] if not s["linked"]]
    linked = [s for s in shown["spans"] if s["linked"]]
    assert {s["trace_id"] for s in own} == {shown["trace_id"]}
    # A sampled request: from the edge straight to its tier topic, no ingest (ADR 0041).
    assert {s["service"] for s in own} == {"edge", "scheduler", "worker"}
    roots = [(s["service"], s["name"]) for s in own if s["parent_span_id"] is None]
    assert roots == [("edge", semconv.SPAN_CHAT)]
    # The batch it rode: the scheduler's send and the worker's receive, another trace.
    assert {(s["service"], s["name"]) for s in linked} >= {("scheduler", batches_span)}
    assert "worker" in {s["service"] for s in linked}
    assert {s["trace_id"] for s in linked} & {shown["trace_id"]} == set()
    # The stages, in data-flow order, add up to the request's time at the edge.
    assert list(shown["stages"]) == list(semconv.STAGES)
    assert all(ms >= 0 for ms in shown["stages"].values()), shown["stages"]
    assert shown["stage_total_ms"] == pytest.approx(shown["total_ms"], rel=0.1)
