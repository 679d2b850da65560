"""Result topologies side by side: reply partitions vs a topic per request, at rising rates.

One stack (ingest, scheduler, sim worker) with two edges on it: one in the `partition`
topology, one in the `topic` topology. At each request rate, each edge gets the same
open-loop load (evenly spaced arrivals over a few sockets) in turn. Per step it reports:

- added TTFT p50/p99: what the client waited for its first delta beyond the engine's own
  time to first token (client TTFT minus the worker's run-start-to-first-token); everything
  the serving path adds, the result path included;
- whether the rate was sustained (every request done, no error, the last answer within 2 s
  of the last send, i.e. no backlog, and client TTFT p99 under 1 s);
- topics and partitions created on the broker during the step, and the edge's own timing
  of its create and delete calls (from its /metrics).

Short on purpose (fits a 2-core machine); a topology stops after failing two rates in a
row, the run once both have; talks to 127.0.0.1 only. Prints one table, writes JSON and a PNG plot.

    python -m bench.result_topology [--rates 5,10,20,40,80,160] [--step-s 4] [--out bench/out]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import websockets
from prometheus_client.parser import text_string_to_metric_families

from services.edge.metrics import ADMIN_BUCKETS
from shared.kafka import make_admin
from shared.settings import TokenbusSettings
from tests.stack import Stack, free_port, new_prefix, wait_until

TOPOLOGIES = ("partition", "topic")
SOCKETS = 4
DRAIN_S = 15.0
TTFT_P99_BOUND_MS = 1000.0
WARMUP_S = 2.0
FAILURES_TO_STOP = 2  # a topology stops after failing this many rates in a row
BACKLOG_S = 2.0  # the last answer may come this long after the step's sending ends


@dataclass
class Sample:
    client_id: str
    sent_at: float
    first_at: float | None = None
    done_at: float | None = None
    engine_ttft_ms: float | None = None
    error: str | None = None


@dataclass
class Step:
    topology: str
    rate: float
    sent: int
    done: int
    errors: int
    achieved_rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    added_ttft_p50_ms: float
    added_ttft_p99_ms: float
    topics_created: int
    partitions_created: int
    topic_create_calls: int
    topic_create_mean_ms: float
    topic_create_p99_ms: float | None  # bucket bound; None: above the top bucket
    topic_delete_calls: int
    topic_delete_mean_ms: float
    topics_deleted: int
    sustained: bool = False
    error_codes: dict[str, int] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def drive(url: str, rate: float, step_s: float, max_tokens: int) -> list[Sample]:
    """Send `rate` requests/s for `step_s` seconds, evenly spaced; wait for every answer."""
    samples: dict[str, Sample] = {}
    by_request: dict[str, Sample] = {}
    pending: set[str] = set()
    all_done = asyncio.Event()
    sockets = [await websockets.connect(url, max_size=2**22) for _ in range(SOCKETS)]

    async def listen(ws: websockets.ClientConnection) -> None:
        async for raw in ws:
            frame: dict[str, Any] = json.loads(raw)
            now = time.perf_counter()
            kind = frame["type"]
            if kind == "chat.accepted":
                by_request[frame["request_id"]] = samples[frame["client_id"]]
                continue
            sample = by_request.get(frame.get("request_id", "")) or samples.get(
                frame.get("client_id") or ""
            )
            if sample is None:
                continue
            if kind == "chat.delta" and sample.first_at is None:
                sample.first_at = now
            elif kind in ("chat.done", "error"):
                sample.done_at = now
                if kind == "error":
                    sample.error = str(frame["code"])
                else:
                    t = frame["timings"]
                    sample.engine_ttft_ms = t["ttft_ms"] - t["queue_ms"]
                pending.discard(sample.client_id)
                if not pending and sending_over.is_set():
                    all_done.set()

    sending_over = asyncio.Event()
    listeners = [asyncio.create_task(listen(ws)) for ws in sockets]
    try:
        start = time.perf_counter()
        count = max(1, round(rate * step_s))
        for i, ws in zip(range(count), itertools.cycle(sockets), strict=False):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            cid = f"b{i}"
            samples[cid] = Sample(client_id=cid, sent_at=time.perf_counter())
            pending.add(cid)
            await ws.send(
                json.dumps(
                    {
                        "type": "chat.request",
                        "client_id": cid,
                        "prompt": f"result topology bench {i}",
                        "max_tokens": max_tokens,
                    }
                )
            )
        sending_over.set()
        if pending:
            # Unfinished requests after the drain count as not done.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_done.wait(), DRAIN_S)
    finally:
        for task in listeners:
            task.cancel()
        for ws in sockets:
            await ws.close()
    return list(samples.values())


class Broker:
    """Counts what exists under the stack's prefix."""

    def __init__(self, bootstrap: str, prefix: str) -> None:
        self.bootstrap = bootstrap
        self.prefix = prefix

    async def topics(self) -> dict[str, int]:
        admin = make_admin(TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=self.bootstrap))
        await admin.start()
        try:
            names = [t for t in await admin.list_topics() if t.startswith(self.prefix + ".")]
            described = await admin.describe_topics(names) if names else []
            return {d["topic"]: len(d["partitions"]) for d in described}
        finally:
            await admin.close()


def scrape(port: int) -> dict[str, float]:
    """The edge's /metrics (on its metrics `port`, never its public one) as
    {sample name + labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{label}}}"] = s.value
    return out


def histogram_delta(before: dict[str, float], after: dict[str, float], name: str) -> list[float]:
    """Per-bucket counts added between two scrapes, as (upper bound, count) flattened."""
    bounds: list[tuple[float, float]] = []
    for key, value in after.items():
        if key.startswith(f"{name}_bucket{{"):
            le = key.split("le=")[1].rstrip("}")
            bound = math.inf if le == "+Inf" else float(le)
            bounds.append((bound, value - before.get(key, 0.0)))
    bounds.sort()
    return [b for pair in bounds for b in pair]


def bucket_p99_ms(flat: list[float]) -> float | None:
    """Upper bound of the bucket holding the 99th percentile; None above the top bucket."""
    pairs = list(zip(flat[::2], flat[1::2], strict=True))
    total = pairs[-1][1] if pairs else 0.0
    for bound, cumulative in pairs:
        if total > 0 and cumulative >= 0.99 * total:
            return None if math.isinf(bound) else round(bound * 1000, 1)
    return None


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def run_step(
    topology: str,
    url: str,
    metrics_port: int,
    broker: Broker,
    rate: float,
    args: argparse.Namespace,
) -> Step:
    topics_before = await broker.topics()
    metrics_before = scrape(metrics_port)
    samples = await drive(url, rate, args.step_s, args.max_tokens)
    # Let the edge's retention sweep delete what this step made before counting deletes.
    await asyncio.sleep(args.retention_s + 0.5)
    metrics_after = scrape(metrics_port)
    topics_after = await broker.topics()

    done = [s for s in samples if s.done_at is not None and s.error is None]
    errors = [s for s in samples if s.error is not None]
    codes: dict[str, int] = {}
    for s in errors:
        codes[s.error or "?"] = codes.get(s.error or "?", 0) + 1
    ttft = [(s.first_at - s.sent_at) * 1000 for s in done if s.first_at is not None]
    added = [
        (s.first_at - s.sent_at) * 1000 - (s.engine_ttft_ms or 0.0)
        for s in done
        if s.first_at is not None
    ]
    span = max((s.done_at or 0) for s in samples) - min(s.sent_at for s in samples)
    created_names = set(topics_after) - set(topics_before)
    made = delta(metrics_before, metrics_after, "tokenbus_edge_result_topics_created_total{}")
    create_count = delta(
        metrics_before, metrics_after, "tokenbus_edge_result_topic_create_seconds_count{}"
    )
    create_sum = delta(
        metrics_before, metrics_after, "tokenbus_edge_result_topic_create_seconds_sum{}"
    )
    delete_count = delta(
        metrics_before, metrics_after, "tokenbus_edge_result_topic_delete_seconds_count{}"
    )
    delete_sum = delta(
        metrics_before, metrics_after, "tokenbus_edge_result_topic_delete_seconds_sum{}"
    )
    step = Step(
        topology=topology,
        rate=rate,
        sent=len(samples),
        done=len(done),
        errors=len(errors),
        achieved_rps=round(len(done) / span, 2) if span > 0 else 0.0,
        ttft_p50_ms=round(percentile(ttft, 50), 1),
        ttft_p99_ms=round(percentile(ttft, 99), 1),
        added_ttft_p50_ms=round(percentile(added, 50), 1),
        added_ttft_p99_ms=round(percentile(added, 99), 1),
        topics_created=int(made) if topology == "topic" else len(created_names),
        partitions_created=int(made) if topology == "topic" else 0,
        topic_create_calls=int(create_count),
        topic_create_mean_ms=round(create_sum / create_count * 1000, 1) if create_count else 0.0,
        topic_create_p99_ms=bucket_p99_ms(
            histogram_delta(
                metrics_before, metrics_after, "tokenbus_edge_result_topic_create_seconds"
            )
        ),
        topic_delete_calls=int(delete_count),
        topic_delete_mean_ms=round(delete_sum / delete_count * 1000, 1) if delete_count else 0.0,
        topics_deleted=int(
            delta(metrics_before, metrics_after, "tokenbus_edge_result_topics_deleted_total{}")
        ),
        error_codes=codes,
    )
    # Sustained: everything answered, no backlog left to drain after the last send.
    step.sustained = (
        step.done == step.sent
        and step.errors == 0
        and span <= args.step_s + BACKLOG_S
        and step.ttft_p99_ms <= TTFT_P99_BOUND_MS
    )
    return step


def start_stack(args: argparse.Namespace, log_dir: Path) -> tuple[Stack, dict[str, int]]:
    stack = Stack(
        bootstrap=args.bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": str(args.token_rate),
            "TOKENBUS_LOG_LEVEL": "WARNING",
            "TOKENBUS_EDGE_RESULT_TOPOLOGY": "partition",
        },
    )
    stack.start()
    topic_port = free_port()
    stack.start_service(
        "edge",
        key="edge-topic",
        TOKENBUS_EDGE_PORT=str(topic_port),
        TOKENBUS_EDGE_RESULT_TOPOLOGY="topic",
        TOKENBUS_EDGE_RESULT_TOPIC_RETENTION_S=str(args.retention_s),
    )
    wait_until(lambda: stack.edge_ready(topic_port), 60, "the topic-topology edge")
    return stack, {"partition": stack.edge_port, "topic": topic_port}


async def bench(args: argparse.Namespace, stack: Stack, ports: dict[str, int]) -> list[Step]:
    broker = Broker(args.bootstrap, stack.prefix)
    steps: list[Step] = []
    failures = dict.fromkeys(TOPOLOGIES, 0)
    edge_keys = {"partition": "edge", "topic": "edge-topic"}  # as `start_stack` started them
    for topology in TOPOLOGIES:
        # Uncounted: first connections, metadata, JIT-cold paths of both edges.
        url = f"ws://127.0.0.1:{ports[topology]}/v1/chat"
        await drive(url, args.rates[0], WARMUP_S, args.max_tokens)
    for rate in args.rates:
        for topology in TOPOLOGIES:
            if failures[topology] >= FAILURES_TO_STOP:
                continue
            port = ports[topology]
            metrics_port = stack.health_ports[edge_keys[topology]]
            step = await run_step(
                topology, f"ws://127.0.0.1:{port}/v1/chat", metrics_port, broker, rate, args
            )
            steps.append(step)
            print(
                f"  {topology:9} {rate:6.1f} req/s: done {step.done}/{step.sent},"
                f" added TTFT p50 {step.added_ttft_p50_ms} ms p99 {step.added_ttft_p99_ms} ms,"
                f" sustained={step.sustained}",
                file=sys.stderr,
                flush=True,
            )
            # Two failed rates in a row, not one: a shared machine has noisy moments.
            failures[topology] = 0 if step.sustained else failures[topology] + 1
        if all(f >= FAILURES_TO_STOP for f in failures.values()):
            break  # both saturated: higher rates only load the machine
    return steps


def table(steps: list[Step]) -> str:
    head = (
        "| rate req/s | topology | done/sent | added TTFT p50 ms | added TTFT p99 ms |"
        " client TTFT p99 ms | topics (partitions) created | create mean / p99 ms |"
        " delete calls, mean ms (topics) | sustained |"
    )
    lines = [head, "|" + "---|" * 10]
    for s in steps:
        create = (
            f"{s.topic_create_mean_ms} / {_p99(s.topic_create_p99_ms)}"
            if s.topic_create_calls
            else "-"
        )
        delete = (
            f"{s.topic_delete_calls}, {s.topic_delete_mean_ms} ({s.topics_deleted})"
            if s.topic_delete_calls
            else "-"
        )
        lines.append(
            f"| {s.rate:g} | {s.topology} | {s.done}/{s.sent} | {s.added_ttft_p50_ms} |"
            f" {s.added_ttft_p99_ms} | {s.ttft_p99_ms} | {s.topics_created}"
            f" ({s.partitions_created}) | {create} | {delete} | {'yes' if s.sustained else 'no'} |"
        )
    best = {t: highest_sustained([s for s in steps if s.topology == t]) for t in TOPOLOGIES}
    lines.append("")
    lines.append(
        "Highest rate sustained (and every rate below it): "
        + ", ".join(f"{t} {best[t]:g} req/s" for t in TOPOLOGIES)
        + f" (of {max(s.rate for s in steps):g} tried)"
    )
    return "\n".join(lines)


def _p99(value: float | None) -> str:
    return f"> {ADMIN_BUCKETS[-1] * 1000:g}" if value is None else f"{value:g}"


def highest_sustained(steps: list[Step]) -> float:
    best = 0.0
    for step in sorted(steps, key=lambda s: s.rate):
        if not step.sustained:
            break
        best = step.rate
    return best


def plot(steps: list[Step], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for topology, color in zip(TOPOLOGIES, ("tab:blue", "tab:red"), strict=True):
        mine = [s for s in steps if s.topology == topology]
        rates = [s.rate for s in mine]
        p50 = [s.added_ttft_p50_ms for s in mine]
        ax.plot(rates, p50, "o-", color=color, label=f"{topology} p50")
        ax.plot(
            rates, [s.added_ttft_p99_ms for s in mine], "s--", color=color, label=f"{topology} p99"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({s.rate for s in steps})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("added TTFT (ms)")
    ax.set_title("Result topology: TTFT added beyond the engine")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rates", default="5,10,20,40,80,160", help="requests/s, rising")
    p.add_argument("--step-s", type=float, default=4.0, help="seconds of load per step")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--token-rate", type=float, default=500.0, help="sim tokens/s per sequence")
    p.add_argument("--retention-s", type=float, default=1.0, help="topic topology retention")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument(
        "--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    )
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    host = args.bootstrap.split(":")[0]
    if host not in ("127.0.0.1", "localhost"):
        p.error("this bench only targets a local broker (127.0.0.1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="result-topology-"))
    started = time.time()
    load_start = os.getloadavg()[0]
    stack, ports = start_stack(args, log_dir)
    try:
        steps = asyncio.run(bench(args, stack, ports))
    finally:
        stack.stop()
    text = table(steps)
    print(text)
    print(f"1-min load average: {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    result = {
        "command": "python -m bench.result_topology " + " ".join(sys.argv[1:]),
        "started_at": started,
        "cpus": os.cpu_count(),
        "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps": [asdict(s) for s in steps],
        "table": text,
    }
    (args.out / "result_topology.json").write_text(json.dumps(result, indent=2))
    plot(steps, args.out / "result_topology.png")
    print(f"wrote {args.out / 'result_topology.json'} and {args.out / 'result_topology.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
