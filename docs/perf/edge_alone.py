"""The edge alone under load: a stand-in pipeline answers each request with DELTAS deltas + done.

Measures the edge process's CPU (utime+stime from /proc) over the load window, per request
and per delta record; optionally records a py-spy flame graph of the edge. From the repo root:

    RATE=30 DURATION=20 DELTAS=64 SVG=edge.svg .venv/bin/python docs/perf/edge_alone.py

(SPY_FORMAT=raw writes collapsed stacks instead of an SVG.)

Run with DELTAS=1 and DELTAS=64 and solve cpu = a * requests + b * deltas (ADR 0023).
PREFIX reuses existing topics (and keeps them) for a broker slow to show new ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from aiokafka import TopicPartition

from bench.loadgen import LoadConfig, run_load
from bench.workload import PlannedRequest
from shared.kafka import make_consumer, make_producer
from shared.messages import DeltaResult, DoneResult, QueuedRequest, RequestRecord, Timings, Usage
from tests.stack import Stack, _create, free_port, new_prefix, wait_until

RATE = float(os.environ.get("RATE", "60"))
DURATION = float(os.environ.get("DURATION", "20"))
DELTAS = int(os.environ.get("DELTAS", "64"))
DELTA_EVERY_S = float(os.environ.get("DELTA_EVERY_S", "0.001"))
SVG = os.environ.get("SVG", "")
SPY_FORMAT = os.environ.get("SPY_FORMAT", "flamegraph")  # or raw: collapsed stacks, for scripts
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def responder(stack: Stack, stop: asyncio.Event) -> None:
    """Answers every request the edge writes (the requests topic, or a tier topic on its
    direct path, ADR 0041): DELTAS deltas (one token each), done."""
    settings = stack.settings
    topics = stack.topics
    consumer = make_consumer(settings, group_id=None, client_id="bench-responder")
    producer = make_producer(settings, client_id="bench-responder")
    await consumer.start()
    await producer.start()
    parts = [
        TopicPartition(topic, p)
        for topic in stack.request_topics
        for p in range(topics.partitions()[topic])
    ]
    consumer.assign(parts)
    for tp in parts:
        await consumer.seek_to_end(tp)
    live: list[tuple[RequestRecord, int]] = []

    async def emit() -> None:
        while not stop.is_set():
            await asyncio.sleep(DELTA_EVERY_S * 8)
            keep = []
            for record, seq in live:
                assert record.reply_to is not None
                rt = record.reply_to
                key = record.request_id.encode()
                for _ in range(8):
                    if seq < DELTAS:
                        value = DeltaResult(
                            request_id=record.request_id, attempt=0, seq=seq, text="tok "
                        )
                    else:
                        value = DoneResult(
                            request_id=record.request_id,
                            attempt=0,
                            seq=seq,
                            finish_reason="length",
                            usage=Usage(prompt_tokens=4, completion_tokens=DELTAS),
                            timings=Timings(queue_ms=0, batch_size=1, ttft_ms=1, total_ms=1),
                        )
                    await producer.send(
                        rt.topic, value.model_dump_json().encode(), key=key, partition=rt.partition
                    )
                    seq += 1
                    if seq > DELTAS:
                        break
                if seq <= DELTAS:
                    keep.append((record, seq))
            live[:] = keep

    emitter = asyncio.create_task(emit())
    try:
        while not stop.is_set():
            fetched = await consumer.getmany(timeout_ms=100)
            for records in fetched.values():
                for r in records:
                    model = RequestRecord if r.topic == topics.requests else QueuedRequest
                    live.append((model.model_validate_json(r.value or b""), 0))
    finally:
        emitter.cancel()
        await consumer.stop()
        await producer.stop()


async def drive(stack: Stack, planned: list[PlannedRequest]) -> object:
    stop = asyncio.Event()
    answer = asyncio.create_task(responder(stack, stop))
    await asyncio.sleep(2)
    try:
        return await run_load(LoadConfig(url=stack.ws_url, connections=8), planned)
    finally:
        stop.set()
        await answer


def main() -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="edgebench-"))
    stack = Stack(
        bootstrap=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:29092"),
        prefix=os.environ.get("PREFIX") or new_prefix(),
        log_dir=log_dir,
        env_overrides={"TOKENBUS_LOG_LEVEL": "WARNING"},
    )
    asyncio.run(_create(stack.settings, stack.topics))
    stack.edge_port = free_port()
    stack.start_service("edge")
    try:
        wait_until(stack.edge_ready, 120, "the edge's /healthz")
        edge = stack.processes["edge"].pid
        n = int(RATE * DURATION)
        planned = [
            PlannedRequest(
                client_id=f"c{i}",
                at_s=i / RATE,
                request_class="bench",
                tier="interactive",
                prompt_tokens=2,
                body={
                    "type": "chat.request",
                    "client_id": f"c{i}",
                    "prompt": "hello there",
                    "max_tokens": DELTAS,
                },
            )
            for i in range(n)
        ]
        spy = None
        if SVG:
            spy = subprocess.Popen(
                [
                    ".venv/bin/py-spy",
                    "record",
                    "-o",
                    SVG,
                    "--pid",
                    str(edge),
                    "-r",
                    "200",
                    "-d",
                    str(int(DURATION) + 4),
                    "--nonblocking",
                    "--format",
                    SPY_FORMAT,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            time.sleep(1.0)
        c0, t0 = cpu_s(edge), time.monotonic()
        result = asyncio.run(drive(stack, planned))
        c1, t1 = cpu_s(edge), time.monotonic()
        if spy is not None:
            spy.wait(timeout=120)
        traces = result.traces  # type: ignore[attr-defined]
        done = [t for t in traces if t.completed]
        deltas = sum(len(t.delta_at) for t in traces)
        accepted = sum(1 for t in traces if t.accepted_at is not None)
        cpu = c1 - c0
        print(
            json.dumps(
                {
                    "rate": RATE,
                    "duration": DURATION,
                    "deltas_per_request": DELTAS,
                    "planned": n,
                    "accepted": accepted,
                    "completed": len(done),
                    "deltas": deltas,
                    "edge_cpu_s": round(cpu, 3),
                    "wall_s": round(t1 - t0, 2),
                    "ms_per_request": round(1000 * cpu / max(1, accepted), 3),
                    "us_per_delta": round(1e6 * cpu / max(1, deltas), 2),
                }
            )
        )
    finally:
        if os.environ.get("PREFIX"):
            for key in list(stack.processes):
                stack.stop_service(key)  # the topics are kept for the next run
        else:
            stack.stop()


if __name__ == "__main__":
    main()
