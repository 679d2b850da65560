"""The session's faultable broker (`faultable_broker`), stopped under the fault stack's ingest
(`fault_stack`) for longer than ingest's Kafka timeouts: ingest stays up and skips nothing.

Requests written before the outage (some still in ingest's hands when the broker stops)
and after it each reach a tier topic exactly once, and the ingest process is the same one
throughout. The outage outlasts the publish timeout (batches expire, the producer breaks and
is renewed) and the group session (ADR 0065).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from shared.kafka import make_producer
from shared.settings import TokenbusSettings
from tests.conftest import FaultableBroker
from tests.stack import FAULT_WINDOW_S, Stack, read_records, wait_until
from tests.worker_logs import events

pytestmark = pytest.mark.integration

OUTAGE_S = FAULT_WINDOW_S


async def write(settings: TokenbusSettings, topic: str, ids: list[str]) -> None:
    producer = make_producer(settings, client_id="test-producer")
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
        keys.extend((r.key or b"").decode() for r in await read_records(stack.settings, tier, 4))
    return keys


@pytest.mark.timeout(600)  # a broker start on a shared machine
async def test_ingest_outlives_a_broker_outage_longer_than_its_timeouts_and_skips_nothing(
    fault_stack: Stack, faultable_broker: FaultableBroker
) -> None:
    stack, run = fault_stack, uuid.uuid4().hex[:8]  # the session's fault stack: ids of its own
    ingest = stack.processes["ingest"]
    before = [f"outage-{run}-before-{n}" for n in range(30)]
    await write(stack.settings, stack.topics.requests, before)

    def forwarding() -> bool:
        return any(
            e.get("request_id") in before for e in events(stack.log("ingest"), "request.admitted")
        )

    # The broker goes while ingest is still forwarding the burst.
    await asyncio.to_thread(wait_until, forwarding, 60, "ingest to be forwarding")
    try:
        await asyncio.to_thread(faultable_broker.stop)
        down_at = time.monotonic()
        while time.monotonic() - down_at < OUTAGE_S:
            assert ingest.poll() is None, "ingest exited during the outage"
            await asyncio.sleep(1)
        await asyncio.to_thread(faultable_broker.start)
        after = [f"outage-{run}-after-{n}" for n in range(10)]
        await write(stack.settings, stack.topics.requests, after)

        deadline = time.monotonic() + 120
        keys: list[str] = []
        while time.monotonic() < deadline:
            keys = [k for k in await on_tiers(stack) if k.startswith(f"outage-{run}-")]
            if set(before + after) <= set(keys):
                break
            await asyncio.sleep(1)
        assert sorted(keys) == sorted(before + after), "each request on a tier exactly once"
        assert stack.processes["ingest"] is ingest
        assert ingest.poll() is None
    finally:
        await asyncio.to_thread(faultable_broker.whole)  # back if the test failed in the outage
