"""Warm pools on a real stack: a model the deployment names (`served_models`) whose worker
is not up yet. A request whose deadline can wait a load is held and answered once a worker
of the model starts; one whose deadline cannot is refused `overloaded` with the load time as
its `retry_after_ms` (WebSocket frame, and the OpenAI API's 503 with its retry headers).
The worker that started keeps its model: later batches run on it, loaded once. `/v1/models`
lists every model of the pools, those with no live worker too."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import websockets

from shared.messages import Heartbeat
from tests.chat_client import ChatSession, openai_sdk
from tests.stack import Stack, new_prefix, wait_until

COLD, WARM, MEASURED = "cold", "warm", "measured"
IDLE = "idle"  # a pool scaled to zero the whole time: no worker of it ever starts
LOAD_S = 20.0  # the scheduler's default load time: no worker of COLD has measured one


@pytest.fixture(scope="module")
def pool(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_SERVED_MODELS": json.dumps([COLD, WARM, MEASURED, IDLE]),
            "TOKENBUS_SCHEDULER_MODEL_LOAD_S": str(LOAD_S),
            # A scheduler takes nothing for cold before it has listened to heartbeats this
            # long (a 2 s deadline would expire first): short, so the tests need not wait.
            "TOKENBUS_SCHEDULER_UNKNOWN_MODEL_AFTER_MS": "300",
        },
        workers={
            "worker-warm": {"TOKENBUS_WORKER_ID": "worker-warm", "TOKENBUS_WORKER_MODEL": WARM}
        },
    )
    try:
        stack.start()
        wait_until(lambda: answers(stack, WARM), 60, "the warm model answering")
        yield stack
    finally:
        stack.stop()


def answers(stack: Stack, model: str) -> bool:
    try:
        openai_sdk(stack).completions.create(model=model, prompt="hi", max_tokens=1)
    except openai.APIError:
        return False
    return True


def ask(client_id: str, model: str, **fields: Any) -> dict[str, Any]:
    return {"client_id": client_id, "prompt": f"{client_id}: warm?", "model": model, **fields}


def final(session: ChatSession, client_id: str) -> dict[str, Any]:
    frame = session.by_client[client_id].final
    assert frame is not None, session.by_client[client_id].frames
    return frame


def test_v1_models_lists_the_pools_models_while_none_of_their_workers_is_live(
    pool: Stack,
) -> None:
    with openai_sdk(pool) as sdk:
        assert {m.id for m in sdk.models.list()} == {COLD, WARM, MEASURED, IDLE}
        card = sdk.models.retrieve(IDLE)
        assert (card.id, card.owned_by) == (IDLE, "tokenbus")
        assert card.created > 0
        with pytest.raises(openai.NotFoundError, match="available models: cold, idle, measured"):
            sdk.models.retrieve("gpt-9")


def test_a_cold_model_over_the_openai_api_is_a_503_with_the_load_time(pool: Stack) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        openai_sdk(pool).chat.completions.create(
            model=COLD,
            messages=[{"role": "user", "content": "hurry"}],
            max_tokens=4,
            extra_body={"deadline_ms": 2000},
        )
    response = caught.value.response
    assert response.status_code == 503
    assert response.headers["retry-after-ms"] == str(int(LOAD_S * 1000))
    assert response.headers["Retry-After"] == str(int(LOAD_S))
    body = caught.value.body
    assert isinstance(body, dict)
    assert f"model {COLD} has no live worker" in body["message"]


async def test_a_cold_model_holds_what_can_wait_until_its_worker_starts(pool: Stack) -> None:
    async with websockets.connect(pool.ws_url) as ws:
        session = ChatSession(ws)
        await session.send(ask("held", COLD, max_tokens=4, deadline_ms=120_000))
        await session.send(ask("waitless", COLD, max_tokens=4))  # no deadline: held too
        await session.send(ask("hurried", COLD, max_tokens=4, deadline_ms=5_000))
        await session.until(lambda: "hurried" in session.ended, within=30)
        error = final(session, "hurried")
        assert (error["type"], error["code"]) == ("error", "overloaded"), error
        assert error["retry_after_ms"] == int(LOAD_S * 1000)
        # Refusing `hurried` took a scheduler step after all three arrived: the others are
        # held, not refused or expired.
        assert session.ended == ["hurried"]
        assert [f["type"] for f in session.by_client["held"].frames] == ["chat.accepted"]
        pool.start_service(
            "worker", "worker-cold", TOKENBUS_WORKER_ID="worker-cold", TOKENBUS_WORKER_MODEL=COLD
        )
        await session.until(lambda: session.all_ended(), within=90)
        for client_id in ("held", "waitless"):
            done = final(session, client_id)
            assert (done["type"], done["model"]) == ("chat.done", COLD), done
        # Later batches run on the same loaded worker: one start, one incarnation, one model.
        for i in range(3):
            await session.send(ask(f"later{i}", COLD, max_tokens=4))
            await session.until(lambda i=i: f"later{i}" in session.ended, within=30)
    assert pool.log("worker-cold").read_text().count("worker.started") == 1
    beats = [Heartbeat.model_validate_json(v) for v in await pool.read_async(pool.topics.workers)]
    cold = {(b.model, b.started_at) for b in beats if b.worker_id == "worker-cold"}
    assert len(cold) == 1, cold
    assert next(iter(cold))[0] == COLD


async def test_a_cold_models_refusal_waits_its_workers_measured_load_time(pool: Stack) -> None:
    """The worker reports its load time in its heartbeats; once it is gone, a request its
    deadline cannot wait is told to retry after that time, not the default."""
    pool.start_service(
        "worker", "worker-measured", TOKENBUS_WORKER_ID="worker-measured",
        TOKENBUS_WORKER_MODEL=MEASURED,
    )  # fmt: skip

    async def measured() -> list[float]:
        beats = [
            Heartbeat.model_validate_json(v) for v in await pool.read_async(pool.topics.workers)
        ]
        return [
            b.load_s for b in beats if b.worker_id == "worker-measured" and b.load_s is not None
        ]

    deadline = time.monotonic() + 60
    while not (loads := await measured()):
        assert time.monotonic() < deadline, "no heartbeat of worker-measured with its load_s"
        await asyncio.sleep(0.2)
    load_s = loads[-1]
    assert 0 < load_s < 60
    pool.stop_service("worker-measured")
    # Until the schedulers count it dead (three silent beats), a request is held and expires;
    # then it is refused at once, told to come back after the measured load.
    async with websockets.connect(pool.ws_url) as ws:
        session = ChatSession(ws)
        for attempt in range(30):
            client_id = f"probe{attempt}"
            await session.send(ask(client_id, MEASURED, max_tokens=4, deadline_ms=300))
            await session.until(lambda c=client_id: c in session.ended, within=30)
            if final(session, client_id)["code"] == "overloaded":
                break
        error = final(session, client_id)
    assert (error["code"], error["retry_after_ms"]) == ("overloaded", math.ceil(load_s * 1000))
