"""A static worker end to end: a batch record runs as one engine call, one batch at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from tests.chat_client import ChatSession, Transcript
from tests.stack import Stack, new_prefix
from tests.test_chat_e2e import expected

ROWS = 5
LONG_TOKENS = 120  # at 200 tokens/s: ~0.6 s, while the short rows end after a few steps


@pytest.fixture
def static_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_BATCH_MODE": "static",
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
