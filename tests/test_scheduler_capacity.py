"""On the real broker: a full worker holds the backlog in the scheduler; deadlines expire there.

One worker with a single sequence slot (`TOKENBUS_WORKER_MAX_NUM_SEQS=1`), so "all workers
full" is one long request away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from shared.messages import Heartbeat
from tests.chat_client import ChatSession
from tests.stack import Stack, new_prefix, wait_until
from tests.test_chat_e2e import check_transcript
from tests.worker_logs import events

TOKEN_RATE = 50  # tokens/s per sequence: the blocker's 121 tokens hold the slot 2.4 s
BLOCKER: dict[str, Any] = {
    "client_id": "blocker",
    "prompt": "hold the only slot 84",
    "max_tokens": 200,
}


@pytest.fixture(scope="module")
def one_slot(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_MAX_NUM_SEQS": "1",
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": str(TOKEN_RATE),
            "TOKENBUS_WORKER_HEARTBEAT_MS": "200",
            # Order must come from priority alone, not from aging.
            "TOKENBUS_SCHEDULER_BACKGROUND_AGING_MS": "60000",
        },
    )
    try:
        s.start()
        wait_until(lambda: _heartbeats(s), 60, "the worker's first heartbeat", interval=0.2)
        yield s
    finally:
        s.stop()


def _heartbeats(stack: Stack) -> list[Heartbeat]:
    return [Heartbeat.model_validate_json(v) for v in stack.read(stack.topics.workers)]


async def test_a_request_whose_deadline_passes_in_the_backlog_is_answered_never_run(
    one_slot: Stack,
) -> None:
    late: dict[str, Any] = {
        "client_id": "late",
        "prompt": "too late",
        "max_tokens": 5,
        "deadline_ms": 300,
    }
    async with websockets.connect(one_slot.ws_url) as ws:
        session = ChatSession(ws)
        await session.send(BLOCKER)
        await session.until(lambda: session.by_client["blocker"].deltas)  # the slot is taken
        await session.send(late)
        await session.until(lambda: "late" in session.ended)
        await session.until(lambda: "blocker" in session.ended)
    t = session.by_client["late"]
    assert t.final is not None
    assert t.final["type"] == "error"
    assert t.final["code"] == "deadline_exceeded", t.final
    assert t.deltas == [], "an expired request must never run"
    check_transcript(session.by_client["blocker"], BLOCKER)
    assert session.ended == ["late", "blocker"]  # answered while the slot was still busy
    # The scheduler answered it; the worker never saw it.
    assert t.request_id is not None
    ran = {e["request_id"] for e in events(one_slot.log("worker"), "request.finished")}
    assert t.request_id not in ran


async def test_with_every_slot_busy_the_backlog_waits_and_leaves_by_priority(
    one_slot: Stack,
) -> None:
    background: list[dict[str, Any]] = [
        {"client_id": f"b{i}", "prompt": f"bulk {i}", "max_tokens": 4, "priority": "background"}
        for i in range(3)
    ]
    interactive: list[dict[str, Any]] = [
        {"client_id": f"i{i}", "prompt": f"chat {i}", "max_tokens": 4} for i in range(3)
    ]
    async with websockets.connect(one_slot.ws_url) as ws:
        session = ChatSession(ws)
        await session.send(BLOCKER)
        await session.until(lambda: session.by_client["blocker"].deltas)
        for request in [*background, *interactive]:  # background first, on purpose
            await session.send(request)
        await session.until(lambda: len(session.ended) == 7)
    for request in [BLOCKER, *background, *interactive]:
        check_transcript(session.by_client[request["client_id"]], request)
    # One slot: requests ran one after another, every interactive one before any background.
    # (Within a tier, order follows acceptance, which spans several partitions.)
    assert session.ended[0] == "blocker"
    assert set(session.ended[1:4]) == {"i0", "i1", "i2"}, session.ended
    assert set(session.ended[4:]) == {"b0", "b1", "b2"}, session.ended
    # The backlog stayed in the scheduler: the worker never held more than its one slot.
    beats = await asyncio.to_thread(_heartbeats, one_slot)
    assert beats, "no heartbeats"
    assert max(len(b.held) for b in beats) == 1
    assert all(b.total_slots == 1 for b in beats)
