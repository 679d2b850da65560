"""One trace per request across the four real services, `tokenbus trace` on it, and /metrics.

A real broker and the four services as processes, each writing its spans as JSON lines
(TOKENBUS_TRACE_DIR) and serving /metrics on TOKENBUS_METRICS_PORT (the edge's too: never on
its public port).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import websockets
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from shared import semconv
from shared.kafka import create_topics, make_producer
from shared.messages import Tier
from shared.telemetry import SpanRecord, read_span_file
from tests.chat_client import run_requests
from tests.stack import ROOT, SERVICES, Stack, _create, free_port, new_prefix, wait_until

pytestmark = pytest.mark.kafka

SCRAPED = ("ingest", "scheduler", "worker")


@dataclass
class TracedStack:
    stack: Stack
    trace_dir: Path

    def spans(self) -> list[SpanRecord]:
        out: list[SpanRecord] = []
        for path in sorted(self.trace_dir.glob("*.jsonl")):
            out.extend(read_span_file(path))
        return out

    def request_spans(self, request_id: str) -> list[SpanRecord]:
        spans = self.spans()
        traces = {s.trace_id for s in spans if s.attributes.get(semconv.REQUEST_ID) == request_id}
        return [s for s in spans if s.trace_id in traces]

    def metrics_url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.stack.health_ports[service]}/metrics"


@pytest.fixture(scope="module")
def traced(
    bootstrap: str, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TracedStack]:
    trace_dir = tmp_path_factory.mktemp("traces")
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_TRACE_DIR": str(trace_dir),
            "TOKENBUS_TRACE_FLUSH_MS": "50",
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": "100",
        },
    )
    try:
        asyncio.run(_create(stack.settings, stack.topics))
        stack.edge_port = free_port()
        for name in SERVICES:
            stack.start_service(name)  # each on a free metrics port (stack.health_ports)
        wait_until(stack.edge_ready, 60, "the edge's /healthz")
        yield TracedStack(stack, trace_dir)
    finally:
        stack.stop()


def service(span: SpanRecord) -> str:
    return span.service.removeprefix("tokenbus-")


# A greedy request the response cache may answer goes through ingest (which holds the
# cache); a sampled one goes from the edge straight to its tier topic (ADR 0041).
THROUGH_INGEST = {"temperature": 0}


async def chat(
    traced: TracedStack, max_tokens: int, prompt: str = "trace me please", **fields: object
) -> tuple[str, dict[str, object], float]:
    """One request; its id, its chat.done frame, and the end-to-end time the client saw."""
    async with websockets.connect(traced.stack.ws_url) as ws:
        began = time.perf_counter()
        transcripts = await run_requests(
            ws, [{"client_id": "c", "prompt": prompt, "max_tokens": max_tokens, **fields}]
        )
        elapsed = time.perf_counter() - began
    t = transcripts["c"]
    assert t.final is not None
    assert t.final["type"] == "chat.done", t.final
    assert t.request_id is not None
    return t.request_id, t.final, elapsed


ALL_FOUR = frozenset({"edge", "ingest", "scheduler", "worker"})
DIRECT = frozenset({"edge", "scheduler", "worker"})


def wait_for_whole_trace(
    traced: TracedStack, request_id: str, services: frozenset[str] = DIRECT
) -> list[SpanRecord]:
    """Spans are written in the background, each process on its own clock: poll until the
    edge's last ones are there and every service on the request's path has written some
    (the worker's may land after the edge's: its run span ends once its records are
    stored). Every stage's span must be there too, and every span's parent (stop 46's clean
    clone saw the worker's four stage spans written before their parent)."""
    found: list[SpanRecord] = []

    def complete() -> bool:
        nonlocal found
        found = traced.request_spans(request_id)
        names = {s.name for s in found}
        # A parent ends after its children and is written after them (the worker's request
        # span after its stage spans): the trace is whole once every parent is there too.
        traces = {s.trace_id for s in found if s.attributes.get(semconv.REQUEST_ID) == request_id}
        ids = {s.span_id for s in found}
        parents = {s.parent_span_id for s in found if s.trace_id in traces} - {None}
        return (
            semconv.SPAN_CHAT in names
            and {s.stage for s in found if s.stage} == set(semconv.STAGES)
            and {service(s) for s in found} >= services
            and parents <= ids
        )

    wait_until(complete, 20, f"the spans of request {request_id}")
    return found


async def test_one_trace_through_all_four_services(traced: TracedStack) -> None:
    # Greedy (cacheable), so through ingest; a prompt of its own, so the cache misses.
    request_id, _, _ = await chat(traced, 8, f"trace me {uuid.uuid4().hex}", **THROUGH_INGEST)
    spans = wait_for_whole_trace(traced, request_id, ALL_FOUR)
    traces = {s.trace_id for s in spans if s.attributes.get(semconv.REQUEST_ID) == request_id}
    assert len(traces) == 1, traces
    trace_id = traces.pop()
    mine = [s for s in spans if s.trace_id == trace_id]
    assert {service(s) for s in mine} == ALL_FOUR

    # The parent chain is intact: one root (the edge's request span), every other span's
    # parent is in the trace.
    ids = {s.span_id for s in mine}
    roots = [s for s in mine if s.parent_span_id is None]
    assert [(service(r), r.name, r.kind) for r in roots] == [("edge", "chat", "SERVER")]
    orphans = [s.name for s in mine if s.parent_span_id is not None and s.parent_span_id not in ids]
    assert orphans == []
    by_id = {s.span_id: s for s in mine}

    def chain(span: SpanRecord) -> list[str]:
        names = [f"{service(span)}:{span.name}"]
        while span.parent_span_id is not None:
            span = by_id[span.parent_span_id]
            names.append(f"{service(span)}:{span.name}")
        return names

    deliver = next(s for s in mine if s.stage == semconv.STAGE_DELIVER)
    path = chain(deliver)
    # Back from the socket to the frame: through the worker, scheduler, ingest and edge.
    hops = [p.split(":")[0] for p in path]
    services_on_path = [h for k, h in enumerate(hops) if k == 0 or hops[k - 1] != h]
    assert services_on_path == ["edge", "worker", "scheduler", "ingest", "edge"], path
    for hop in ("worker:worker.request", "scheduler:stage batch_form", "edge:chat"):
        assert hop in path, path
    assert {s.stage for s in mine if s.stage} == set(semconv.STAGES)

    # Ingest traced its consume, as a child of the edge's producer span.
    process = next(s for s in mine if service(s) == "ingest" and s.kind == "CONSUMER")
    assert by_id[process.parent_span_id or ""].name == f"send {traced.stack.topics.requests}"

    # The batch span: a trace of its own, linked to this request's batch_form span.
    form = next(s for s in mine if s.stage == semconv.STAGE_BATCH_FORM)
    everything = traced.spans()
    batch_spans = [
        s
        for s in everything
        if s.name == f"send {traced.stack.topics.batches}"
        and any(link.span_id == form.span_id for link in s.links)
    ]
    assert len(batch_spans) == 1
    batch_span = batch_spans[0]
    assert batch_span.trace_id != trace_id
    assert batch_span.attributes[semconv.MESSAGING_BATCH_MESSAGE_COUNT] >= 1
    receive = [s for s in everything if s.parent_span_id == batch_span.span_id]
    assert [(service(s), s.kind) for s in receive] == [("worker", "CONSUMER")]
    run = next(s for s in mine if s.name == semconv.SPAN_WORKER_REQUEST)
    assert [link.span_id for link in run.links] == [receive[0].span_id]

    # Every log line about the request carries its trace id.
    log = (traced.stack.log_dir / f"{traced.stack.prefix}-worker.log").read_text()
    finished = [x for x in log.splitlines() if f"request_id={request_id!r}" in x]
    assert finished
    assert all(f"trace_id='{trace_id}'" in x for x in finished), finished


async def test_one_trace_on_the_direct_path(traced: TracedStack) -> None:
    """A sampled request goes from the edge straight to its tier topic: one trace through the
    edge, the scheduler and the worker, every stage in it (`admit` is the edge's)."""
    request_id, _, _ = await chat(traced, max_tokens=8)
    spans = wait_for_whole_trace(traced, request_id, DIRECT)
    assert len({s.trace_id for s in spans}) == 1
    assert {service(s) for s in spans} == DIRECT
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if s.parent_span_id is None]
    assert [(service(r), r.name) for r in roots] == [("edge", "chat")]
    assert all(s.parent_span_id in by_id for s in spans if s.parent_span_id is not None)
    admit = next(s for s in spans if s.stage == semconv.STAGE_ADMIT)
    assert service(admit) == "edge"
    assert admit.attributes[semconv.ADMISSION] == "direct"
    tier_topic = traced.stack.topics.tier(Tier.interactive)
    assert admit.attributes[semconv.MESSAGING_DESTINATION_NAME] == tier_topic
    # The scheduler's stages continue the edge's producer span of the tier record.
    queue_wait = next(s for s in spans if s.stage == semconv.STAGE_QUEUE_WAIT)
    assert service(queue_wait) == "scheduler"
    assert by_id[queue_wait.parent_span_id or ""].name == f"send {tier_topic}"


async def test_an_external_producers_traceparent_is_continued(traced: TracedStack) -> None:
    stack = traced.stack
    reply_topic = f"{stack.prefix}.ext-replies"
    await create_topics(stack.settings, {reply_topic: 1})
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    request_id = "ext-" + uuid.uuid4().hex[:8]
    record = {
        "request_id": request_id,
        "prompt": "from an app with its own trace",
        "max_tokens": 6,
        "reply_to": {"topic": reply_topic},
    }
    producer = make_producer(stack.settings, client_id="external-app")
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap, enable_auto_commit=False)
    await producer.start()
    await consumer.start()
    try:
        consumer.assign([TopicPartition(reply_topic, 0)])
        await consumer.seek_to_beginning(TopicPartition(reply_topic, 0))
        await producer.send_and_wait(
            stack.topics.requests,
            json.dumps(record).encode(),
            key=request_id.encode(),
            headers=[("traceparent", f"00-{trace_id}-{parent_id}-01".encode())],
        )
        final = None
        deadline = time.monotonic() + 30
        while final is None and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for rec in (r for records in batch.values() for r in records):
                if json.loads(rec.value)["kind"] in ("done", "error"):
                    final = rec
        assert final is not None, "no final result on the reply topic"
        assert json.loads(final.value)["kind"] == "done"
        headers = dict(final.headers)
        assert headers["traceparent"].decode().split("-")[1] == trace_id
    finally:
        await consumer.stop()
        await producer.stop()

    def continued() -> bool:
        # Every hop's spans, and each span's parent with them: a parent ends, and is
        # exported, after its children (seconds later on a loaded machine).
        spans = traced.request_spans(request_id)
        ids = {s.span_id for s in spans} | {parent_id}
        return (
            {service(s) for s in spans} >= {"ingest", "scheduler", "worker"}
            and any(s.stage == semconv.STAGE_RESULT_PUBLISH for s in spans)
            and all(s.parent_span_id in ids for s in spans)
        )

    wait_until(continued, 20, "the external request's spans")
    spans = traced.request_spans(request_id)
    assert {s.trace_id for s in spans} == {trace_id}
    # Ingest's consume span is a child of the producer's own span.
    process = next(s for s in spans if service(s) == "ingest" and s.kind == "CONSUMER")
    assert process.parent_span_id == parent_id
    ids = {s.span_id for s in spans} | {parent_id}
    assert all(s.parent_span_id in ids for s in spans)


def run_trace_cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from tokenbus.cli import main; sys.exit(main())",
         "trace", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )  # fmt: skip
    return done.stdout


async def test_trace_waterfall_stages_add_up_to_the_client_time(traced: TracedStack) -> None:
    request_id, done, client_s = await chat(traced, max_tokens=32)
    wait_for_whole_trace(traced, request_id)

    waterfall = json.loads(run_trace_cli(request_id, "--dir", str(traced.trace_dir), "--json"))
    client_ms = client_s * 1000
    stages = waterfall["stages"]
    assert list(stages) == list(semconv.STAGES)
    stage_ms = waterfall["stage_total_ms"]
    assert abs(stage_ms - client_ms) <= 0.05 * client_ms, (stage_ms, client_ms, stages)
    # The worker's stages are the measurements chat.done reports.
    timings = done["timings"]
    assert isinstance(timings, dict)
    upto_ttft = sum(stages[k] for k in semconv.STAGES[semconv.STAGES.index("admit") :][:5])
    assert abs(upto_ttft - float(timings["ttft_ms"])) < 1.0, (upto_ttft, timings)

    text = run_trace_cli(request_id, "--dir", str(traced.trace_dir))
    lines = text.splitlines()
    assert lines[0].startswith(f"request {request_id}")
    assert {line.split()[0] for line in lines[3:] if line and line[0] != " "} >= DIRECT
    assert "stage prefill" in text
    assert "linked (the batch this request rode):" in text

    slowest = run_trace_cli("--slowest", "3", "--dir", str(traced.trace_dir))
    assert request_id in slowest


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def total(
    scraped: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    return sum(
        v
        for (n, ls), v in scraped.items()
        if n == name and set(labels.items()) <= set(ls)
    )  # fmt: skip


async def test_metrics_count_fifty_requests(traced: TracedStack) -> None:
    services = ("edge", *SCRAPED)
    before = {s: scrape(traced.metrics_url(s)) for s in services}
    n = 50
    requests = [
        # Through ingest (greedy, each prompt its own, so the cache misses): every service counts.
        {"client_id": f"m{i}", "prompt": f"count me {i} {uuid.uuid4().hex}", "max_tokens": 8}
        | THROUGH_INGEST
        for i in range(n)
    ]
    async with websockets.connect(traced.stack.ws_url) as ws:
        transcripts = await run_requests(ws, requests, timeout=120)
    finals = [t.final for t in transcripts.values()]
    assert all(f is not None and f["type"] == "chat.done" for f in finals), finals
    done = [f for f in finals if f is not None]
    completion = sum(f["usage"]["completion_tokens"] for f in done)
    prompt = sum(f["usage"]["prompt_tokens"] for f in done)

    def delta(service: str, name: str, **labels: str) -> float:
        return total(after[service], name, **labels) - total(before[service], name, **labels)

    # Metrics are observed just after the last frame or record: poll until they settle.
    after: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}

    def settled() -> bool:
        after.update({s: scrape(traced.metrics_url(s)) for s in services})
        return (
            delta("edge", "tokenbus_edge_request_duration_seconds_count") == n
            and delta("worker", "gen_ai_server_request_duration_seconds_count") == n
        )

    wait_until(settled, 20, "the metrics of 50 requests")
    i = {"tier": "interactive"}
    # edge
    assert delta("edge", "tokenbus_edge_requests_total", **i) == n
    assert delta("edge", "tokenbus_edge_responses_total", **i) == n
    assert delta("edge", "tokenbus_edge_time_to_first_delta_seconds_count", **i) == n
    assert delta("edge", "tokenbus_edge_delivery_seconds_count", **i) == n
    assert total(after["edge"], "tokenbus_edge_requests_in_flight") == 0
    # ingest
    assert delta("ingest", "tokenbus_ingest_records_total", outcome="admitted", **i) == n
    assert delta("ingest", "tokenbus_ingest_admit_seconds_count", **i) == n
    assert (
        "tokenbus_consumer_lag_records",
        (("topic", traced.stack.topics.requests),),
    ) in after["ingest"]
    # scheduler
    assert delta("scheduler", "tokenbus_tier_queue_wait_seconds_count", **i) == n
    assert delta("scheduler", "tokenbus_batch_size_sum", **i) == n
    batches = delta("scheduler", "tokenbus_batches_total", **i)
    assert 1 <= batches <= n
    assert delta("scheduler", "tokenbus_batch_size_count", **i) == batches
    assert delta("scheduler", "tokenbus_batch_fill_ratio_count", **i) == batches
    assert total(after["scheduler"], "tokenbus_tier_queue_depth", **i) == 0
    # worker
    for name in (
        "gen_ai_server_time_to_first_token_seconds_count",
        "gen_ai_server_time_per_output_token_seconds_count",
        "tokenbus_request_queue_seconds_count",
    ):
        assert delta("worker", name, **i) == n, name
    assert delta("worker", "tokenbus_worker_requests_total", outcome="length", **i) == n
    assert delta("worker", "tokenbus_worker_tokens_total", type="output", **i) == completion
    assert delta("worker", "tokenbus_worker_tokens_total", type="input", **i) == prompt
    assert delta("worker", "tokenbus_worker_batches_total", **i) == batches
    assert (
        "tokenbus_worker_slots_capacity",
        (),
    ) in after["worker"]
    # The latencies are the very numbers chat.done reported to the clients.
    sums = defaultdict(float)
    for f in done:
        for key in ("queue_ms", "ttft_ms", "total_ms"):
            sums[key] += f["timings"][key] / 1000
    for name, key in (
        ("tokenbus_request_queue_seconds_sum", "queue_ms"),
        ("gen_ai_server_time_to_first_token_seconds_sum", "ttft_ms"),
        ("gen_ai_server_request_duration_seconds_sum", "total_ms"),
    ):
        assert delta("worker", name, **i) == pytest.approx(sums[key], rel=1e-9, abs=1e-6), name
