"""Per-request topics of a crashed edge: another edge's sweeper deletes them, and only them.

Two edges of their own in topic topology on the session's stack (`Stack.own_edge`). Edge A
finishes a few streams and is killed with SIGKILL before its own retention deletes their
topics; edge B's sweeper must delete them within a bounded time, while it keeps a topic
still being written (a stream of the dead edge that the worker goes on producing).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator

import pytest
import websockets

from services.edge.resume import verify
from services.worker.engines.sim_text import complete
from shared.kafka import make_admin
from tests.chat_client import recv_json
from tests.stack import Stack
from tests.tenants import paced

TOKEN_RATE = 5  # sim tokens/s
RETENTION_S = 3.0  # an edge deletes its own topics this long after their streams end
ORPHAN_AFTER_S = 6.0  # the sweeper: no write for this long, and no edge reads it
SWEEP_INTERVAL_S = 1.0
# A 117-token answer: 23 s at TOKEN_RATE (the shared stack paces it: tests/tenants.py).
LONG_PROMPT = paced("outage stream 11", TOKEN_RATE)


# The edges' settings: per-request topics, deleted soon after their streams end, and a
# sweeper that deletes a dead edge's soon after their last write.
TOPIC_EDGE_ENV = {
    "TOKENBUS_EDGE_RESULT_TOPOLOGY": "topic",
    "TOKENBUS_EDGE_RESULT_TOPIC_RETENTION_S": str(RETENTION_S),
    "TOKENBUS_EDGE_RESULT_TOPIC_ORPHAN_AFTER_S": str(ORPHAN_AFTER_S),
    "TOKENBUS_EDGE_RESULT_TOPIC_SWEEP_INTERVAL_S": str(SWEEP_INTERVAL_S),
}


@pytest.fixture(scope="module")
def two_edges(stack: Stack) -> Iterator[tuple[int, int]]:
    """Edges A and B of the session's stack (issue 36), both in topic topology: the test
    kills A; B sweeps."""
    with (
        stack.own_edge("sweep-a", **TOPIC_EDGE_ENV) as port_a,
        stack.own_edge("sweep-b", **TOPIC_EDGE_ENV) as port_b,
    ):
        yield port_a, port_b


async def request(
    stack: Stack, ws: websockets.ClientConnection, prompt: str, max_tokens: int
) -> str:
    """Send a request; return its per-request topic (from the resume token)."""
    await ws.send(
        json.dumps(
            {
                "type": "chat.request",
                "client_id": prompt,
                "prompt": prompt,
                "max_tokens": max_tokens,
            }
        )
    )
    accepted = await recv_json(ws)
    assert accepted["type"] == "chat.accepted", accepted
    return verify(accepted["resume_token"], stack.resume_keys, now=time.time()).topic


async def existing(stack: Stack) -> set[str]:
    admin = make_admin(stack.settings)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def test_a_crashed_edges_topics_are_swept_by_another_edge(
    stack: Stack, two_edges: tuple[int, int]
) -> None:
    port_a, _ = two_edges
    assert complete(LONG_PROMPT, 500).completion_tokens > TOKEN_RATE * (ORPHAN_AFTER_S + 5)
    async with websockets.connect(stack.ws_url_as("default", port_a)) as ws:
        finished = [await request(stack, ws, paced(f"short {i}", TOKEN_RATE), 3) for i in range(3)]
        ends = 0
        while ends < len(finished):  # every short stream has ended on edge A
            frame = await recv_json(ws)
            ends += frame["type"] in ("chat.done", "error")
        long_topic = await request(stack, ws, LONG_PROMPT, 500)
        await recv_json(ws)  # its first delta: the worker writes it now
        # Killed before its retention (RETENTION_S) deletes the finished streams' topics.
        stack.stop_service("sweep-a", signal.SIGKILL)
        killed_at = time.monotonic()
    topics = await existing(stack)
    assert set(finished) <= topics, "edge A deleted its topics before it was killed"

    # Edge B's sweeper: the finished streams' topics go once their last write is old enough.
    deadline = killed_at + ORPHAN_AFTER_S + 10 * SWEEP_INTERVAL_S + 30
    while set(finished) & (topics := await existing(stack)):
        assert time.monotonic() < deadline, f"still there: {set(finished) & topics}"
        await asyncio.sleep(0.5)
    swept_after = time.monotonic() - killed_at
    # The dead edge's stream still being written is kept (written within ORPHAN_AFTER_S).
    assert long_topic in topics, f"a topic being written was swept after {swept_after:.1f} s"
    swept = (stack.log("sweep-b")).read_text()
    assert "result_topics.swept" in swept
