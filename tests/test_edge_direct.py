"""The edge's direct path (ADR 0041): a request the response cache cannot answer goes from the
edge straight to its tier topic; a cacheable one, or every one with the path turned off, goes
through `tokenbus.requests` and ingest. A request no batch could hold is refused at the edge.

A real broker and the four services; one edge with the default, one with the path off.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from shared.messages import QueuedRequest, Tier
from tests.chat_client import run_requests
from tests.stack import Stack, free_port, new_prefix, wait_until

pytestmark = pytest.mark.kafka

BUDGET = 500  # the largest tier token budget in this stack


@pytest.fixture(scope="module")
def two_edges(bootstrap: str, log_dir: Path) -> Iterator[tuple[Stack, int]]:
    """A stack whose default edge takes the direct path, and a second edge that does not."""
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_SCHEDULER_INTERACTIVE_MAX_BATCH_TOKENS": "300",
            "TOKENBUS_SCHEDULER_BACKGROUND_MAX_BATCH_TOKENS": str(BUDGET),
        },
    )
    try:
        stack.start()
        port = free_port()
        stack.start_service(
            "edge",
            key="edge-via-ingest",
            TOKENBUS_EDGE_PORT=str(port),
            TOKENBUS_EDGE_DIRECT_TO_TIER="false",
        )
        wait_until(lambda: stack.edge_ready(port), 60, "the second edge's /readyz")
        yield stack, port
    finally:
        stack.stop()


def sampled(client_id: str) -> dict[str, Any]:
    return {"client_id": client_id, "prompt": f"sampled {uuid.uuid4().hex}", "max_tokens": 8}


def greedy(client_id: str) -> dict[str, Any]:
    return sampled(client_id) | {"temperature": 0}


async def ask(url: str, requests: list[dict[str, Any]]) -> dict[str, str]:
    """Send the requests on one socket; each client_id's request_id, once all are done."""
    async with websockets.connect(url) as ws:
        transcripts = await run_requests(ws, requests, timeout=60)
    for t in transcripts.values():
        assert t.final is not None, t.frames
        assert t.final["type"] == "chat.done", t.frames
        assert t.request_id is not None
    return {cid: t.request_id for cid, t in transcripts.items() if t.request_id is not None}


async def written_ids(stack: Stack, topic: str) -> set[str]:
    return {json.loads(v)["request_id"] for v in await stack.read_async(topic)}


async def tier_records(stack: Stack) -> dict[str, QueuedRequest]:
    """Every record on the tier topics, each validated as the scheduler reads it."""
    out: dict[str, QueuedRequest] = {}
    for tier in Tier:
        for value in await stack.read_async(stack.topics.tier(tier)):
            record = QueuedRequest.model_validate_json(value)
            out[record.request_id] = record
    return out


async def test_sampled_requests_skip_ingest_and_cacheable_ones_do_not(
    two_edges: tuple[Stack, int],
) -> None:
    stack, _ = two_edges
    ids = await ask(stack.ws_url, [sampled("s"), greedy("g"), greedy("o") | {"cache": False}])
    requests = await written_ids(stack, stack.topics.requests)
    queued = await tier_records(stack)
    # Sampled, or greedy but opted out of the cache: written to its tier by the edge alone.
    for direct in (ids["s"], ids["o"]):
        assert direct not in requests
        assert queued[direct].tier is Tier.interactive
        assert queued[direct].prompt_tokens > 0
        assert queued[direct].cache_key is None
    # Greedy: through ingest, which keys it for the response cache and forwards it.
    assert ids["g"] in requests
    assert queued[ids["g"]].cache_key is not None


async def test_with_the_direct_path_off_every_request_goes_through_ingest(
    two_edges: tuple[Stack, int],
) -> None:
    stack, port = two_edges
    ids = await ask(stack.ws_url_as("default", port), [sampled("s2"), greedy("g2")])
    requests = await written_ids(stack, stack.topics.requests)
    assert set(ids.values()) <= requests
    assert set(ids.values()) <= set(await tier_records(stack))


async def test_a_request_no_batch_could_hold_is_refused_at_the_edge(
    two_edges: tuple[Stack, int],
) -> None:
    stack, _ = two_edges
    client_id = f"big-{uuid.uuid4().hex[:8]}"
    async with websockets.connect(stack.ws_url) as ws:
        transcripts = await run_requests(
            ws, [{"client_id": client_id, "prompt": "hello", "max_tokens": BUDGET}], timeout=30
        )
    frames = transcripts[client_id].frames
    assert [f["type"] for f in frames] == ["error"], frames
    assert frames[0]["code"] == "invalid_request"
    assert f"above the largest batch token budget of {BUDGET}" in frames[0]["message"]
    # Nothing of it was written anywhere.
    everything = [
        json.loads(v)
        for topic in (stack.topics.requests, *(stack.topics.tier(t) for t in Tier))
        for v in await stack.read_async(topic)
    ]
    assert not [r for r in everything if r.get("client_id") == client_id]
