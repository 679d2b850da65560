"""The session's faultable broker (`faultable_broker`), stopped under ingest for longer than
ingest's Kafka timeouts: ingest stays up and skips nothing.

Requests written before the outage (some still in ingest's hands when the broker stops)
and after it each reach a tier topic exactly once, and the ingest process is the same one
throughout. The outage outlasts the publish timeout (batches expire, the producer breaks and
is renewed) and the group session (ADR 0065).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from shared.kafka import make_producer
from shared.settings import TokenbusSettings
from tests.conftest import FaultableBroker
from tests.ingest_kafka import read_all
from tests.stack import (
    FAULT_WINDOW_S,
    SHORT_CLIENT_TIMEOUTS,
    Stack,
    _create,
    new_prefix,
    wait_until,
)
from tests.worker_logs import events

pytestmark = pytest.mark.integration

OUTAGE_S = FAULT_WINDOW_S


async def write(bootstrap: str, topic: str, ids: list[str]) -> None:
    producer = make_producer(
        TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap), client_id="test-producer"
    )
    await producer.start()
    try:
        for rid in ids:
            body = {"request_id": rid, "prompt": f"outage {rid}", "max_tokens": 2}
            await producer.send(topic, json.dumps(body).encode(), key=rid.encode())
        await producer.flush()
    finally:
        await producer.stop()


async def on_tiers(stack: Stack) -> list[str]:
    keys: list[str] = []
    for tier in stack.topics.tiers:
        keys.extend((r.key or b"").decode() for r in await read_all(stack.bootstrap, tier, 4))
    return keys


@pytest.mark.timeout(600)  # a broker start on a shared machine
async def test_ingest_outlives_a_broker_outage_longer_than_its_timeouts_and_skips_nothing(
    faultable_broker: FaultableBroker, log_dir: Path
) -> None:
    stack = Stack(
        bootstrap=faultable_broker.bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            **SHORT_CLIENT_TIMEOUTS,
            # Retries back off to 2 s, so the test sees ingest back soon after the broker.
            "TOKENBUS_INGEST_RETRY_BACKOFF_MAX_MS": "2000",
        },
    )
    await _create(stack.settings, stack.topics)
    stack.start_service("ingest")
    try:
        log = stack.log("ingest")
        await asyncio.to_thread(
            wait_until, lambda: events(log, "memory.recalled"), 90, "ingest to be up"
        )
        pid = stack.processes["ingest"].pid
        before = [f"before-{n}" for n in range(30)]
        await write(stack.bootstrap, stack.topics.requests, before)
        # The broker goes while ingest is still forwarding the burst.
        await asyncio.to_thread(
            wait_until, lambda: events(log, "request.admitted"), 60, "ingest to be forwarding"
        )
        await asyncio.to_thread(faultable_broker.stop)
        down_at = time.monotonic()
        while time.monotonic() - down_at < OUTAGE_S:
            assert stack.processes["ingest"].poll() is None, "ingest exited during the outage"
            await asyncio.sleep(1)
        await asyncio.to_thread(faultable_broker.start)
        after = [f"after-{n}" for n in range(10)]
        await write(stack.bootstrap, stack.topics.requests, after)

        deadline = time.monotonic() + 120
        keys: list[str] = []
        while time.monotonic() < deadline:
            keys = await on_tiers(stack)
            if set(before + after) <= set(keys):
                break
            await asyncio.sleep(1)
        assert sorted(keys) == sorted(before + after), "each request on a tier exactly once"
        assert stack.processes["ingest"].poll() is None
        assert stack.processes["ingest"].pid == pid
    finally:
        await asyncio.to_thread(faultable_broker.whole)  # back if the test failed in the outage
        await asyncio.to_thread(stack.stop)
