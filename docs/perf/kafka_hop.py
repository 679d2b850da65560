"""A bare Kafka hop on this machine: what two services' records cost before tokenbus's work.

One process writes a record every GAP ms (a `make_producer` producer: idempotent, acks=all,
linger 0, as every tokenbus producer) and times each acknowledgement; another reads them
(a 500 ms long poll) and times each record's way from send to receipt (one machine, one
clock). From the repo root, against a running broker:

    .venv/bin/python docs/perf/kafka_hop.py 127.0.0.1:19092 hop-probe
    N=400 GAP=0 .venv/bin/python docs/perf/kafka_hop.py 127.0.0.1:19092 hop-probe

Run it a few times: the broker's JIT warms over the first few thousand records.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import uvloop
from aiokafka import TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shared.kafka import create_topics, make_consumer, make_producer
from shared.settings import TokenbusSettings

N = int(os.environ.get("N", "400"))
GAP_MS = float(os.environ.get("GAP", "20"))


def percentiles(name: str, values: list[float]) -> str:
    v = sorted(values)
    return (
        f"{name} p50 {v[len(v) // 2]:.2f} p90 {v[int(len(v) * 0.9)]:.2f}"
        f" p99 {v[int(len(v) * 0.99)]:.2f} ms"
    )


def settings(bootstrap: str) -> TokenbusSettings:
    return TokenbusSettings.model_validate({"KAFKA_BOOTSTRAP_SERVERS": bootstrap})


async def produce(bootstrap: str, topic: str) -> None:
    producer = make_producer(settings(bootstrap), client_id="hop-probe")
    await producer.start()
    acks: list[float] = []
    try:
        await asyncio.sleep(2)  # the reader is at the end by now
        for i in range(N):
            sent = time.time()
            await producer.send_and_wait(topic, json.dumps({"i": i, "t": sent}).encode())
            acks.append((time.time() - sent) * 1000)
            await asyncio.sleep(GAP_MS / 1000)
    finally:
        await producer.stop()
    print(percentiles("acknowledgement", acks))


async def consume(bootstrap: str, topic: str) -> None:
    consumer = make_consumer(
        settings(bootstrap), group_id=None, client_id="hop-probe", fetch_max_wait_ms=500
    )
    await consumer.start()
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    await consumer.seek_to_end(tp)
    hops: list[float] = []
    try:
        while len(hops) < N:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                now = time.time()
                hops.extend((now - json.loads(r.value or b"{}")["t"]) * 1000 for r in records)
    finally:
        await consumer.stop()
    print(percentiles("hop", hops))


async def create(bootstrap: str, topic: str) -> None:
    await create_topics(settings(bootstrap), {topic: 1})


def main() -> None:
    role, (bootstrap, topic) = os.environ.get("HOP_ROLE", ""), sys.argv[1:3]
    if role:
        uvloop.run({"produce": produce, "consume": consume}[role](bootstrap, topic))
        return
    uvloop.run(create(bootstrap, topic))
    env = dict(os.environ)
    reader = subprocess.Popen(
        [sys.executable, __file__, bootstrap, topic], env=env | {"HOP_ROLE": "consume"}
    )
    time.sleep(1.5)
    subprocess.run(
        [sys.executable, __file__, bootstrap, topic], env=env | {"HOP_ROLE": "produce"}, check=True
    )
    reader.wait(timeout=120)


if __name__ == "__main__":
    main()
