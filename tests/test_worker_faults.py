"""On the real stack: an engine that fails a request, and a prompt over the model's context.

What the WebSocket client sees: exactly one `error` with a stable code for the failed
request, nothing after it, and the requests beside it and after it answered in full by the
same worker process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from services.worker.engines.sim_text import complete
from tests.chat_client import ChatSession, Transcript
from tests.stack import Stack, new_prefix
from tests.worker_logs import events

MARKER = "INJECT-ENGINE-FAULT"
CONTEXT = 64


@pytest.fixture(scope="module")
def fault_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_SIM_FAIL_MARKER": MARKER,
            "TOKENBUS_WORKER_MAX_MODEL_LEN": str(CONTEXT),
        },
    )
    try:
        yield s.start()
    finally:
        s.stop()


def only_error(t: Transcript) -> dict[str, Any]:
    """The transcript's one final frame, an error, and nothing after it."""
    finals = [f for f in t.frames if f["type"] in ("chat.done", "error")]
    assert len(finals) == 1, t.frames
    assert finals[0]["type"] == "error", t.frames
    assert t.frames[-1] is finals[0], t.frames
    return finals[0]


def answered_in_full(t: Transcript, request: dict[str, Any]) -> None:
    assert t.final is not None, t.frames
    assert t.final["type"] == "chat.done", t.frames
    assert [f["type"] for f in t.frames].count("chat.done") == 1
    assert t.text == complete(request["prompt"], request["max_tokens"]).text


async def test_engine_failures_and_long_prompts_get_one_error_each_and_the_worker_serves_on(
    fault_stack: Stack,
) -> None:
    stack = fault_stack
    worker = stack.processes["worker"]
    pid = worker.pid
    failing = {"client_id": "fails", "prompt": f"tell a long story {MARKER} now", "max_tokens": 40}
    too_long = {"client_id": "long", "prompt": "word " * (CONTEXT + 10), "max_tokens": 5}
    beside = {"client_id": "beside", "prompt": "tell a long story now", "max_tokens": 20}
    after = {"client_id": "after", "prompt": "and another one", "max_tokens": 12}
    async with websockets.connect(stack.ws_url) as ws:
        session = ChatSession(ws)
        for request in (failing, too_long, beside):  # sent together: they share batches
            await session.send(request)
        await session.until(session.all_ended, within=60)
        await session.send(after)
        await session.until(session.all_ended, within=60)
    t = session.by_client
    error = only_error(t["fails"])
    assert error["code"] == "internal", error
    assert len(t["fails"].deltas) <= 1  # the engine failed it after its first token
    error = only_error(t["long"])
    assert error["code"] == "invalid_request", error
    assert f"context length of {CONTEXT} tokens" in error["message"]
    assert t["long"].deltas == []
    answered_in_full(t["beside"], beside)
    answered_in_full(t["after"], after)
    # One process served them all, and logged the engine's failure with its traceback.
    assert worker.poll() is None
    assert worker.pid == pid
    log = stack.log("worker")
    assert [e["request_id"] for e in events(log, "request.engine_failed")] == [
        t["fails"].request_id
    ]
    finished = {e["request_id"]: e for e in events(log, "request.finished")}
    assert finished[t["long"].request_id]["finish_reason"] == "invalid_request"
    assert finished[t["long"].request_id]["completion_tokens"] == 0
