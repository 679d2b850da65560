"""Models and fallback on a real stack: two sim models of different speeds, `big` saturated.

Requests that allow a fallback meet their deadlines on `small`, and `chat.done` says so;
the others wait, or expire with `deadline_exceeded`. An unknown model is refused with the
models available: by the edge (WebSocket, OpenAI API) and, for a record a producer wrote
to Kafka directly, by the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import websockets

from shared.kafka import create_topics, make_producer
from tests.chat_client import ChatSession, openai_sdk, recv_json, served_models
from tests.stack import Stack, new_prefix, read_topic, wait_until

BIG, SMALL = "big", "small"
BIG_SLOTS = 2
BIG_TOKENS = 30  # at 10 tokens/s: 3 s a request on `big`
DEADLINE_MS = 4000  # one wave of `big`'s slots fits, two do not


@pytest.fixture(scope="module")
def two_models(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        service_env={
            "worker": {
                "TOKENBUS_WORKER_MODEL": BIG,
                "TOKENBUS_WORKER_MAX_NUM_SEQS": str(BIG_SLOTS),
                "TOKENBUS_WORKER_SIM_TOKEN_RATE": "10",
            }
        },
    )
    try:
        stack.start()
        stack.start_service(
            "worker",
            key="worker-small",
            TOKENBUS_WORKER_ID="worker-small",
            TOKENBUS_WORKER_MODEL=SMALL,
            TOKENBUS_WORKER_MAX_NUM_SEQS="8",
            TOKENBUS_WORKER_SIM_TOKEN_RATE="400",
        )
        wait_until(
            lambda: set(served_models(stack)) == {BIG, SMALL}, 60, "both models on /v1/models"
        )
        # A new edge refuses no model for its first seconds (it may not have heard them all).
        wait_until(lambda: refuses_unknown(stack), 30, "the edge refusing unknown models")
        yield stack
    finally:
        stack.stop()


def refuses_unknown(stack: Stack) -> bool:
    try:
        openai_sdk(stack).completions.create(model="gpt-9", prompt="hi", max_tokens=1)
    except openai.NotFoundError:
        return True
    except openai.BadRequestError:
        return False  # let through by the edge, refused by the scheduler
    return False


def ask(client_id: str, model: str, **fields: Any) -> dict[str, Any]:
    return {"client_id": client_id, "prompt": f"{client_id}: why buses?", "model": model, **fields}


def final(session: ChatSession, client_id: str) -> dict[str, Any]:
    frame = session.by_client[client_id].final
    assert frame is not None, session.by_client[client_id].frames
    return frame


async def test_requests_that_allow_a_fallback_meet_their_deadlines_on_it(
    two_models: Stack,
) -> None:
    async with websockets.connect(two_models.ws_url) as ws:
        session = ChatSession(ws)
        # Saturate `big`: its two slots, and two waves queued behind them.
        waiting = [f"wait{i}" for i in range(3 * BIG_SLOTS)]
        for cid in waiting:
            await session.send(ask(cid, BIG, max_tokens=BIG_TOKENS))
        # The scheduler estimates from what it has seen finish: once the first wave is done.
        await session.until(lambda: len(session.ended) >= 1, within=60)
        falling = [f"fall{i}" for i in range(4)]
        strict = [f"strict{i}" for i in range(2)]
        sent_at = time.monotonic()
        for cid in falling:
            await session.send(
                ask(cid, BIG, max_tokens=BIG_TOKENS, deadline_ms=DEADLINE_MS, fallback_model=SMALL)
            )
        for cid in strict:
            await session.send(ask(cid, BIG, max_tokens=BIG_TOKENS, deadline_ms=DEADLINE_MS))
        await session.until(lambda: all(c in session.ended for c in falling + strict), within=60)
        fell_back_in = time.monotonic() - sent_at
        for cid in falling:
            done = final(session, cid)
            assert done["type"] == "chat.done", done
            assert done["model"] == SMALL
            assert done["timings"]["total_ms"] <= DEADLINE_MS
        assert fell_back_in < 30  # nobody waited for `big`'s whole backlog
        for cid in strict:
            error = final(session, cid)
            assert (error["type"], error["code"]) == ("error", "deadline_exceeded"), error
        # The ones without a deadline wait their turn on `big`, and are answered there.
        await session.until(lambda: all(c in session.ended for c in waiting), within=90)
        assert {final(session, cid)["model"] for cid in waiting} == {BIG}


async def test_an_unknown_model_over_the_websocket_lists_the_models_available(
    two_models: Stack,
) -> None:
    async with websockets.connect(two_models.ws_url) as ws:
        await ws.send(json.dumps({"type": "chat.request", **ask("x", "gpt-9", max_tokens=4)}))
        frame = await recv_json(ws)
        assert (frame["type"], frame["code"], frame["client_id"]) == (
            "error",
            "invalid_request",
            "x",
        )
        assert frame["message"] == "model 'gpt-9' is not served here; available models: big, small"
        await ws.send(
            json.dumps(
                {"type": "chat.request", **ask("y", SMALL, max_tokens=4, fallback_model="nope")}
            )
        )
        frame = await recv_json(ws)
        assert (frame["code"], frame["client_id"]) == ("invalid_request", "y")
        assert "'nope'" in frame["message"]


def test_an_unknown_model_over_the_openai_api_and_the_model_that_answered(
    two_models: Stack,
) -> None:
    client = openai_sdk(two_models)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "model_not_found",
        "model",
    )
    assert error["message"] == "model 'gpt-9' is not served here; available models: big, small"
    answer = client.chat.completions.create(
        model=SMALL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.model == SMALL


async def test_the_scheduler_refuses_a_model_nobody_serves_from_a_direct_producer(
    two_models: Stack,
) -> None:
    """Past the edge (any Kafka client may write requests): the answer is on its reply_to."""
    settings = two_models.settings
    reply_topic = f"{two_models.prefix}.direct-replies"
    await create_topics(settings, {reply_topic: 1})
    request_id = "direct-" + uuid.uuid4().hex[:8]
    record = {
        "request_id": request_id,
        "prompt": "straight to kafka",
        "max_tokens": 4,
        "model": "gpt-9",
        "reply_to": {"topic": reply_topic},
    }
    producer = make_producer(settings, client_id="test-direct")
    await producer.start()
    try:
        await producer.send_and_wait(
            two_models.topics.requests, json.dumps(record).encode(), key=request_id.encode()
        )
    finally:
        await producer.stop()
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while not results and time.monotonic() < deadline:
        results = [json.loads(v) for v in await read_topic(settings, reply_topic, 1)]
        if not results:
            await asyncio.sleep(0.2)  # poll interval between reads, not a wait for an event
    assert len(results) == 1, results
    (error,) = results
    assert (error["request_id"], error["kind"], error["code"]) == (
        request_id,
        "error",
        "invalid_request",
    )
    assert error["message"] == "model 'gpt-9' is not served here; available models: big, small"
