"""Token coalescing on a real broker: Kafka records per token, and the gap between chunks.

One worker process (sim engine, a cost-model profile) gets one batch of concurrent
requests straight on the batches topic; the bench reads every result record back and
the worker's own `request.finished` log lines (chunk gaps on its monotonic clock).

    KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:19092 python -m bench.coalescing \
        --json bench/results/coalescing.json --plot bench/results/coalescing.png
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.service_logs import events
from bench.stats import percentiles
from services.worker.engines.sim_profiles import sim_profile
from shared.kafka import create_topics, delete_topics, encode, make_producer, wait_for_broker
from shared.messages import Batch, QueuedRequest, ReplyTo, Tier
from shared.settings import TokenbusSettings
from shared.tokens import sim_tokens
from shared.topics import Topics

ROOT = Path(__file__).resolve().parent.parent
BATCH_PARTITION = 0  # the worker's own partition of the batches topic


@dataclass
class CoalescingRun:
    profile: str
    flush_ms: float
    flush_tokens: int
    requests: int
    tokens: int
    delta_records: int
    final_records: int
    step_ms: float  # the profile's decode step at this concurrency and the largest KV
    kafka_gap_ms: dict[str, float]  # consecutive delta records of one request, CreateTime
    worker_max_gap_ms: dict[str, float]  # per request, the worker's largest chunk gap
    worker_mean_wait_ms: dict[str, float]  # per request, mean wait of a chunk's oldest token
    # per request, the largest (chunk gap - the engine's longest pause in that chunk's window):
    # what coalescing itself added; its contract is <= flush_ms
    worker_gap_over_engine_ms: dict[str, float]
    worker_flush_lateness_ms: dict[str, float]  # per request, the most a chunk left past flush time

    @property
    def records_per_token(self) -> float:
        return (self.delta_records + self.final_records) / self.tokens

    @property
    def delta_records_per_token(self) -> float:
        return self.delta_records / self.tokens

    @property
    def gap_bound_ms(self) -> float:
        return self.flush_ms + self.step_ms

    def row(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "records_per_token": round(self.records_per_token, 4),
            "delta_records_per_token": round(self.delta_records_per_token, 4),
            "gap_bound_ms": round(self.gap_bound_ms, 3),
        }


def batch_of(requests: int, max_tokens: int, reply_to: ReplyTo) -> Batch:
    queued = [
        QueuedRequest(
            request_id=f"co-{i}-{uuid.uuid4().hex[:8]}",
            prompt=f"coalescing bench request number {i}: tell me about the bus",
            max_tokens=max_tokens,
            tier=Tier.interactive,
            prompt_tokens=sim_tokens(f"coalescing bench request number {i}"),
            reply_to=reply_to,
        )
        for i in range(requests)
    ]
    return Batch(batch_id=uuid.uuid4().hex, tier=Tier.interactive, requests=queued, reason="full")


async def measure(
    bootstrap: str,
    *,
    profile: str,
    flush_ms: float = 20.0,
    flush_tokens: int = 16,
    requests: int = 16,
    max_tokens: int = 128,
    log_dir: Path | None = None,
) -> CoalescingRun:
    """Run one batch through a fresh worker process; return what Kafka carried."""
    prefix = "bco" + uuid.uuid4().hex[:8]
    topics = Topics(prefix)
    settings = TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap, topic_prefix=prefix)
    await wait_for_broker(settings, timeout_s=30)
    await create_topics(settings, topics.partitions())
    log = (log_dir or Path(tempfile.mkdtemp())) / f"{prefix}-worker.log"
    env = dict(
        os.environ,
        KAFKA_BOOTSTRAP_SERVERS=bootstrap,
        TOKENBUS_TOPIC_PREFIX=prefix,
        TOKENBUS_WORKER_SIM_PROFILE=profile,
        TOKENBUS_WORKER_FLUSH_MS=str(flush_ms),
        TOKENBUS_WORKER_FLUSH_TOKENS=str(flush_tokens),
        TOKENBUS_WORKER_ID=f"{prefix}-w",
        TOKENBUS_WORKER_BATCH_PARTITION=str(BATCH_PARTITION),
        PYTHONPATH=str(ROOT),
    )
    with log.open("ab") as out:
        worker = subprocess.Popen(  # noqa: ASYNC220 (started once, waited on at the end)
            [sys.executable, "-m", "services.worker"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    reply_to = ReplyTo(topic=topics.results, partition=0)
    # A one-request batch first, so the worker's producer knows the partition's leader
    # before the measured batch: the measurement is of the steady state.
    warmup = batch_of(1, 4, reply_to)
    batch = batch_of(requests, max_tokens, reply_to)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    producer = make_producer(settings, client_id="bench-coalescing")
    stamps: dict[str, list[int]] = {r.request_id: [] for r in batch.requests}
    finals = 0
    tokens = 0
    try:
        await consumer.start()
        # A worker reads its own batches partition from the live end at start: send only
        # once its first heartbeat says it is reading.
        consumer.assign([TopicPartition(topics.workers, 0)])
        while not any((await consumer.getmany(timeout_ms=500)).values()):
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited before its first heartbeat; see {log}")
        consumer.assign([TopicPartition(topics.results, 0)])
        await producer.start()
        await producer.send_and_wait(
            topics.batches, encode(warmup), key=warmup.batch_id.encode(), partition=BATCH_PARTITION
        )
        deadline = time.monotonic() + 120
        sent = False
        while finals < requests:
            if not sent and finals == 1:
                finals, tokens, sent = 0, 0, True
                await producer.send_and_wait(
                    topics.batches,
                    encode(batch),
                    key=batch.batch_id.encode(),
                    partition=BATCH_PARTITION,
                )
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError(f"worker did not finish the batch; see {log}")
            fetched = await consumer.getmany(timeout_ms=500)
            for records in fetched.values():
                for record in records:
                    value = json.loads(record.value or b"{}")
                    if value["request_id"] not in stamps:
                        finals += value["kind"] != "delta"  # the warm-up request
                    elif value["kind"] == "delta":
                        stamps[value["request_id"]].append(record.timestamp)
                    else:
                        finals += 1
                        tokens += value["usage"]["completion_tokens"]
    finally:
        await producer.stop()
        await consumer.stop()
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
        await delete_topics(settings, topics.partitions())
    finished = [e for e in events(log, "request.finished") if e["request_id"] in stamps]
    gaps = [float(b - a) for s in stamps.values() for a, b in itertools.pairwise(s)]
    kv = requests * (max(r.prompt_tokens for r in batch.requests) + max_tokens)
    step = sim_profile(profile, max_num_seqs=64, token_rate=50.0).step_seconds(requests, kv)
    return CoalescingRun(
        profile=profile,
        flush_ms=flush_ms,
        flush_tokens=flush_tokens,
        requests=requests,
        tokens=tokens,
        delta_records=sum(len(s) for s in stamps.values()),
        final_records=finals,
        step_ms=round(step * 1000, 3),
        kafka_gap_ms=percentiles(gaps),
        worker_max_gap_ms=percentiles([float(e["max_chunk_gap_ms"]) for e in finished]),
        worker_mean_wait_ms=percentiles([float(e["mean_chunk_wait_ms"]) for e in finished]),
        worker_gap_over_engine_ms=percentiles(
            [float(e["max_chunk_gap_over_token_gap_ms"]) for e in finished]
        ),
        worker_flush_lateness_ms=percentiles([float(e["max_flush_lateness_ms"]) for e in finished]),
    )


def table(runs: list[CoalescingRun]) -> str:
    head = (
        "| profile | flush_ms | flush_tokens | tokens | delta recs | records/token (all) "
        "| tokens/chunk | step ms | bound ms | worker max gap p50/max ms "
        "| Kafka gap p50/p99/max ms | gap over engine pause, max ms "
        "| chunk overdue (loop lag), max ms | oldest-token wait mean ms |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in runs:
        lines.append(
            f"| {r.profile} | {r.flush_ms:g} | {r.flush_tokens} | {r.tokens} | {r.delta_records} "
            f"| {r.records_per_token:.3f} | {r.tokens / r.delta_records:.2f} | {r.step_ms:.2f} "
            f"| {r.gap_bound_ms:.2f} "
            f"| {r.worker_max_gap_ms['p50']:.1f} / {r.worker_max_gap_ms['max']:.1f} "
            f"| {r.kafka_gap_ms['p50']:.0f} / {r.kafka_gap_ms['p99']:.0f} / "
            f"{r.kafka_gap_ms['max']:.0f} "
            f"| {r.worker_gap_over_engine_ms['max']:.1f} "
            f"| {r.worker_flush_lateness_ms['max']:.1f} "
            f"| {r.worker_mean_wait_ms['p50']:.1f} |"
        )
    return "\n".join(lines)


def plot(runs: list[CoalescingRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.profile}\nflush {r.flush_ms:g}ms/{r.flush_tokens}t" for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(labels, [r.records_per_token for r in runs])
    left.axhline(1 / 3, color="red", linestyle="--", label="1 record / 3 tokens")
    left.set_ylabel("Kafka records per token")
    left.legend()
    x = range(len(runs))
    width = 0.27
    for i, (name, pick) in enumerate(
        (("p50", "p50"), ("p99", "p99"), ("max", "max")),
    ):
        right.bar(
            [k + (i - 1) * width for k in x],
            [r.kafka_gap_ms[pick] for r in runs],
            width,
            label=f"chunk gap {name}",
        )
    right.scatter(list(x), [r.gap_bound_ms for r in runs], color="red", label="flush_ms + step")
    right.set_xticks(list(x), labels)
    right.set_ylabel("ms between a request's chunks (Kafka CreateTime)")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    runs = []
    for profile in ("llama3-8b-h100", "llama3-8b-h200"):
        for flush_ms, flush_tokens in ((20.0, 16), (20.0, 1)):
            runs.append(
                await measure(
                    bootstrap,
                    profile=profile,
                    flush_ms=flush_ms,
                    flush_tokens=flush_tokens,
                    requests=args.requests,
                    max_tokens=args.max_tokens,
                )
            )
    print(table(runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.row() for r in runs], indent=2))
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(runs, args.plot)


if __name__ == "__main__":
    asyncio.run(main())
