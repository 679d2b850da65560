"""A broker outage longer than the clients' timeouts under a scheduler and a worker with a
stream under way.

On the session's faultable broker (`faultable_broker`; the shared one is never stopped),
under the session's fault stack (`fault_stack`): the scheduler and the worker keep running
through the outage, and once the broker is back the stream that was running ends with
exactly one final record of its last attempt, and a new request is answered in full. The
outage outlasts the producers' request timeout (batches expire and producers break), the
scheduler's group session and the worker's heartbeats (ADR 0065). Requests go straight to
the tier topic (the edge's and ingest's part of the outage is tested with them), their
results to a topic of the test's own that it reads.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest
from aiokafka.errors import KafkaError

from services.worker.engines.sim_text import complete
from shared.kafka import create_topics, make_producer
from shared.messages import QueuedRequest, ReplyTo, Tier
from shared.settings import TokenbusSettings
from tests.conftest import FaultableBroker
from tests.factories import long_prompts
from tests.stack import FAULT_STACK_ENV, FAULT_WINDOW_S, Stack, read_topic, wait_until

pytestmark = pytest.mark.integration

OUTAGE_S = FAULT_WINDOW_S
TOKEN_RATE = int(FAULT_STACK_ENV["TOKENBUS_WORKER_SIM_TOKEN_RATE"])  # sim tokens/s


def queued(rid: str, prompt: str, reply: str, max_tokens: int) -> bytes:
    return (
        QueuedRequest(
            request_id=rid,
            prompt=prompt,
            max_tokens=max_tokens,
            tier=Tier.interactive,
            prompt_tokens=4,
            reply_to=ReplyTo(topic=reply, partition=0),
        )
        .model_dump_json()
        .encode()
    )


async def produce(settings: TokenbusSettings, topic: str, value: bytes) -> None:
    producer = make_producer(settings, "test-producer")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value)
    finally:
        await producer.stop()


def read_results(settings: TokenbusSettings, topic: str) -> dict[str, list[dict[str, Any]]]:
    """Every result record on `topic` now, per request; {} while the broker cannot say."""
    try:
        values = asyncio.run(asyncio.wait_for(read_topic(settings, topic, 1), 30))
    except (KafkaError, OSError, TimeoutError):
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for value in values:
        record = json.loads(value)
        out.setdefault(record["request_id"], []).append(record)
    return out


def ended(records: list[dict[str, Any]]) -> bool:
    """The last attempt written has its final record."""
    top = max(r["attempt"] for r in records)
    return any(r["attempt"] == top and r["kind"] in ("done", "error") for r in records)


@pytest.mark.timeout(900)  # the broker's own restart can take minutes on two busy cores
def test_scheduler_and_worker_ride_out_a_broker_outage_longer_than_their_timeouts(
    fault_stack: Stack, faultable_broker: FaultableBroker
) -> None:
    stack, run = fault_stack, uuid.uuid4().hex[:8]  # the session's fault stack: ids of its own
    before, after = f"before-{run}", f"after-{run}"
    # An application's reply topic, where the worker may write; deleted with the stack's.
    reply = stack.topics.app_replies(f"outage-{run}")
    settings = stack.settings  # the secured broker's admin login
    asyncio.run(create_topics(settings, {reply: 1}))
    try:
        pids = {key: p.pid for key, p in stack.processes.items()}
        tier = stack.topics.tier(Tier.interactive)
        # 100+ tokens at TOKEN_RATE: 12+ s, still streaming when the broker goes.
        [long_prompt] = long_prompts(1, 100, "a stream across the outage")
        asyncio.run(produce(settings, tier, queued(before, long_prompt, reply, 500)))
        wait_until(
            lambda: before in read_results(settings, reply),
            60,
            "the stream to start",
        )

        assert not ended(read_results(settings, reply)[before])  # mid-stream
        faultable_broker.stop()
        down_until = time.monotonic() + OUTAGE_S
        while time.monotonic() < down_until:  # the outage itself: both keep running
            for key, proc in stack.processes.items():
                assert proc.poll() is None, f"{key} exited during the outage"
            time.sleep(1.0)
        faultable_broker.start()

        after_prompt = "asked once the broker is back"
        asyncio.run(produce(settings, tier, queued(after, after_prompt, reply, 12)))

        def both_ended() -> bool:
            got = read_results(settings, reply)
            return all(rid in got and ended(got[rid]) for rid in (before, after))

        wait_until(both_ended, 300, "both requests to end", interval=1.0)
        for key, proc in stack.processes.items():
            assert proc.poll() is None, f"{key} exited"
            assert proc.pid == pids[key]
        got = read_results(settings, reply)
        for rid, prompt, max_tokens in (
            (before, long_prompt, 500),
            (after, after_prompt, 12),
        ):
            records = got[rid]
            top = max(r["attempt"] for r in records)
            last = [r for r in records if r["attempt"] == top]
            finals = [r for r in last if r["kind"] in ("done", "error")]
            assert len(finals) == 1, last
            if finals[0]["kind"] == "done":
                deltas = sorted((r for r in last if r["kind"] == "delta"), key=lambda r: r["seq"])
                assert [d["seq"] for d in deltas] == list(range(len(deltas)))
                assert "".join(d["text"] for d in deltas) == complete(prompt, max_tokens).text
        assert got[after][-1]["kind"] == "done"
    finally:
        faultable_broker.whole()  # back if the test failed in the outage
