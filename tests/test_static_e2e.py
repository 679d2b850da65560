"""A static worker end to end: a batch record runs as one engine call, one batch at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from tests.chat_client import ChatSession, Transcript
from tests.stack import Stack, new_prefix
from tests.test_chat_e2e import expected

ROWS = 5
LONG_TOKENS = 120  # the sim's answer is shorter: ~60 tokens, ~2.4 s at 25 tokens/s


@pytest.fixture(scope="module")
def static_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_BATCH_MODE": "static",
            # Slow enough that a batch is still running while the tests act on it.
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": "25",
            "TOKENBUS_WORKER_MAX_NUM_SEQS": "8",
            "TOKENBUS_SCHEDULER_INTERACTIVE_MAX_BATCH_SIZE": "8",
            # Long enough for the first wave to leave as one bus on a loaded machine.
            "TOKENBUS_SCHEDULER_INTERACTIVE_MAX_WAIT_MS": "400",
        },
    )
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _streams(t: Transcript) -> bool:
    return bool(t.deltas)


async def test_a_batch_runs_as_one_call_and_the_next_waits_for_its_longest_row(
    static_stack: Stack,
) -> None:
    wave = [
        {
            "client_id": f"a{i}",
            "prompt": f"static row {i}",
            "max_tokens": LONG_TOKENS if i == 0 else 3,
        }
        for i in range(ROWS)
    ]
    async with websockets.connect(static_stack.ws_url) as ws:
        session = ChatSession(ws)
        for request in wave:
            await session.send(request)
        a = session.by_client
        await session.until(lambda: all(_streams(a[str(r["client_id"])]) for r in wave), 60)
        # Every row of the wave has started: a request now cannot join its batch, and
        # starts only when the batch's longest row has ended.
        await session.send({"client_id": "b", "prompt": "late", "max_tokens": 3})
        await session.until(lambda: _streams(a["b"]) or "a0" in session.ended, 60)
        assert "a0" in session.ended, "the late request started before the batch ended"
        assert not _streams(a["b"])
        await session.until(session.all_ended, 60)
    dones = {c: t.frames[-1] for c, t in a.items()}
    assert all(d["type"] == "chat.done" for d in dones.values()), dones
    for request in wave:
        text, tokens, finish = expected(request)
        assert a[request["client_id"]].text == text
        assert dones[request["client_id"]]["usage"]["completion_tokens"] == tokens
        assert dones[request["client_id"]]["finish_reason"] == finish
    assert expected(wave[0])[1] > 3 * expected(wave[1])[1]  # the long row is long
    sizes = [dones[f"a{i}"]["timings"]["batch_size"] for i in range(ROWS)]
    assert max(sizes) >= 2, f"the wave never formed a batch of several: {sizes}"
    if sizes[0] == ROWS:
        # One batch: each short row was answered when its own row ended, before the long.
        assert session.ended.index("a0") == ROWS - 1, session.ended
    assert "batch.one_call" in static_stack.log("worker").read_text()


async def test_a_cancel_ends_its_row_and_a_deadline_expires_while_the_worker_is_busy(
    static_stack: Stack,
) -> None:
    async with websockets.connect(static_stack.ws_url) as ws:
        session = ChatSession(ws)
        s = session.by_client
        # 117 tokens (the sim's answer to this prompt): ~4.7 s at 25 tokens/s.
        await session.send({"client_id": "long", "prompt": "a long one 2", "max_tokens": 2000})
        await session.until(lambda: _streams(s["long"]), 60)
        # The static worker runs its batch and advertises no slot: a request whose deadline
        # passes meanwhile is answered by the scheduler, never run.
        await session.send(
            {"client_id": "late", "prompt": "in a hurry", "max_tokens": 3, "deadline_ms": 300}
        )
        await session.until(lambda: "late" in session.ended, 60)
        assert s["late"].frames[-1]["type"] == "error"
        assert s["late"].frames[-1]["code"] == "deadline_exceeded"
        assert not _streams(s["late"])
        request_id = s["long"].request_id
        await ws.send(json.dumps({"type": "chat.cancel", "request_id": request_id}))
        await session.until(lambda: "long" in session.ended, 60)
        assert s["long"].frames[-1]["code"] == "cancelled"
        # Its batch ended with its only row: the worker takes the next one.
        await session.send({"client_id": "next", "prompt": "next one", "max_tokens": 3})
        await session.until(lambda: "next" in session.ended, 60)
        assert s["next"].frames[-1]["type"] == "chat.done"
