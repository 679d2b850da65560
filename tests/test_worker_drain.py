"""SIGTERM under load: the worker drains, hands back what is unfinished, and nothing is lost."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from services.worker.engines.sim_text import complete
from shared.kafka import make_admin
from shared.messages import QueuedRequest, ReplyTo, Tier
from shared.settings import TokenbusSettings
from tests.chat_client import Transcript, recv_json
from tests.stack import Stack, new_prefix, wait_until
from tests.worker_logs import events

REQUESTS = 16


def test_next_attempt_keeps_the_request_and_counts_up() -> None:
    request = QueuedRequest(
        request_id="r1",
        prompt="p",
        tier=Tier.background,
        prompt_tokens=1,
        reply_to=ReplyTo(topic="t", partition=2),
        attempt=2,
    )
    again = request.next_attempt()
    assert again.attempt == 3
    assert again.model_dump(exclude={"attempt"}) == request.model_dump(exclude={"attempt"})


@pytest.fixture(scope="module")
def drain_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            # One request per batch, so batches spread over both workers' partitions.
            "TOKENBUS_SCHEDULER_INTERACTIVE_MAX_BATCH_SIZE": "1",
            # Streams of 24-120 tokens take 0.6-3 s: most are mid-stream at SIGTERM.
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": "40",
            "TOKENBUS_WORKER_DRAIN_TIMEOUT_S": "0.3",
        },
    )
    try:
        s.start()
        s.start_service("worker", key="worker-b", TOKENBUS_WORKER_ID="worker-b")
        # Batches are addressed to workers the scheduler has heard from: wait for both.
        wait_until(
            lambda: len(s.workers_heard()) == 2,
            60,
            "heartbeats from both workers",
            interval=0.2,
        )
        yield s
    finally:
        s.stop()


async def group_state(bootstrap: str, group: str) -> tuple[str, int]:
    """The consumer group's state and member count, as the broker reports them."""
    admin = make_admin(TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap))
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([group])
        (described,) = response.to_object()["groups"]
        return str(described["state"]), len(described["members"])
    finally:
        await admin.close()


async def test_sigterm_under_load_loses_no_request(drain_stack: Stack) -> None:
    stack = drain_stack
    requests: list[dict[str, Any]] = [
        {"client_id": f"d{i}", "prompt": f"drain me gently, number {i}", "max_tokens": 500}
        for i in range(REQUESTS)
    ]
    by_client = {r["client_id"]: Transcript(client_id=r["client_id"]) for r in requests}
    by_request: dict[str, Transcript] = {}
    async with websockets.connect(stack.ws_url) as ws:
        for r in requests:
            await ws.send(json.dumps({"type": "chat.request", **r}))

        async def pump() -> None:
            open_ = set(by_client)
            while open_:
                frame = await recv_json(ws, 60)
                if frame["type"] == "chat.accepted":
                    t = by_client[frame["client_id"]]
                    t.request_id = frame["request_id"]
                    by_request[frame["request_id"]] = t
                else:
                    t = by_request[frame["request_id"]]
                t.frames.append(frame)
                if frame["type"] in ("chat.done", "error"):
                    open_.discard(t.client_id)

        pumping = asyncio.create_task(pump())
        deadline = asyncio.get_running_loop().time() + 30
        while not all(t.deltas for t in by_client.values()):
            assert asyncio.get_running_loop().time() < deadline, "streams did not start"
            await asyncio.sleep(0.02)
        # Every stream is running now; SIGTERM the first worker and wait for it to exit.
        await asyncio.to_thread(stack.stop_service, "worker", signal.SIGTERM)
        await asyncio.wait_for(pumping, 90)

    worker_a = stack.processes["worker"]
    assert worker_a.returncode == 0, "a drained worker exits cleanly"
    log_a = stack.log_dir / f"{stack.prefix}-worker.log"
    assert events(log_a, "drain.finished"), "worker A did not log the end of its drain"
    handed_back = {e["request_id"] for e in events(log_a, "request.handed_back")}
    assert handed_back, "the test must catch worker A with unfinished requests"

    for r in requests:
        t = by_client[r["client_id"]]
        assert t.final is not None
        assert t.final["type"] == "chat.done", t.final
        plan = complete(str(r["prompt"]), int(r["max_tokens"]))
        last = t.final_attempt
        deltas = [f for f in last if f["type"] == "chat.delta"]
        assert [d["seq"] for d in deltas] == list(range(len(deltas)))
        shown = [(f["type"], f.get("attempt"), f.get("seq"), f.get("text")) for f in t.frames]
        assert "".join(d["text"] for d in deltas) == plan.text, shown
        assert t.final["usage"]["completion_tokens"] == plan.completion_tokens
        # A handed-back request's next attempt continues its answer (ADR 0071): the client
        # sees one answer, no `chat.reset`, and the text above is the uninterrupted one.
        assert [f for f in t.frames if f["type"] == "chat.reset"] == [], shown
    print(f"\nhanded back by the draining worker: {len(handed_back)} of {REQUESTS}")
