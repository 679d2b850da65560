"""Issue 38, item 2 on a real stack: an engine that dies, or hangs, inside a live worker.

Two sim workers, each with a fault file (TOKENBUS_WORKER_SIM_FAULT_FILE). A long answer
starts; its worker's engine is made to die (`dead`) or hang (`hang`). Before, a dead engine
failed the request `internal` and the worker went on advertising every slot free; a hung
one held it until the edge's stall rule ended it `internal` a minute later. Now the worker
exits (code 70) within seconds, and what the WebSocket client sees is one answer, whole:
the text the sim gives uninterrupted, once, after the reset that announced its next
attempt. The dead worker is started again, as its supervisor would, and serves.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from services.worker.engine_health import EXIT_ENGINE_SICK
from services.worker.engines.sim_text import complete
from tests.chat_client import ChatSession
from tests.stack import Stack, new_prefix, wait_until
from tests.test_engine_health import strike

WORKERS = ("worker-a", "worker-b")
STALL_S = 3.0
PROMPT = "tell me about engines that stop"
MAX_TOKENS = 1500  # 7.5 s at the stack's 200 tokens/s: still running when the fault comes


@pytest.fixture(scope="module")
def sick_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    prefix = new_prefix()
    workers = {
        name: {
            "TOKENBUS_WORKER_ID": name,
            "TOKENBUS_WORKER_SIM_FAULT_FILE": str(log_dir / f"{prefix}-{name}.fault"),
            "TOKENBUS_WORKER_ENGINE_STALL_S": str(STALL_S),
        }
        for name in WORKERS
    }
    stack = Stack(bootstrap=bootstrap, prefix=prefix, log_dir=log_dir, workers=workers)
    try:
        stack.start()
        wait_until(lambda: stack.workers_heard() >= set(WORKERS), 60, "both workers")
        yield stack
    finally:
        stack.stop()


def slots_in_use(stack: Stack, worker: str) -> float:
    found = re.search(r"^tokenbus_worker_slots_in_use ([0-9.]+)$", stack.metrics(worker), re.M)
    return float(found.group(1)) if found else 0.0


def running_it(stack: Stack) -> str:
    """The worker running the one request in flight (its slots-in-use gauge says so)."""
    busy: list[str] = []

    def one_busy() -> bool:
        busy[:] = [w for w in WORKERS if w in stack.processes and slots_in_use(stack, w) >= 1]
        return len(busy) == 1

    wait_until(one_busy, 10, "the worker running the request")
    return busy[0]


@pytest.mark.parametrize("fault", ["dead", "hang"])
async def test_a_sick_engine_ends_its_worker_and_the_answer_is_whole_elsewhere(
    sick_stack: Stack, fault: str
) -> None:
    stack = sick_stack
    request = {"client_id": fault, "prompt": f"{PROMPT} ({fault})", "max_tokens": MAX_TOKENS}
    request["ignore_eos"] = True  # to MAX_TOKENS, never its natural end
    async with websockets.connect(stack.ws_url) as ws:
        chat = ChatSession(ws)
        await chat.send(request)
        await chat.until(lambda: bool(chat.by_client[fault].deltas), 30)
        sick = running_it(stack)
        fault_file = Path(stack.workers[sick]["TOKENBUS_WORKER_SIM_FAULT_FILE"])
        struck = time.monotonic()
        strike(fault_file, fault)
        wait_until(lambda: sick in stack.exited(), 30, f"{sick} to exit")
        took = time.monotonic() - struck
        t = chat.by_client[fault]
        await chat.until(lambda: t.final is not None, 60)
    assert stack.exited()[sick] == EXIT_ENGINE_SICK
    # A hang is seen after STALL_S of silence; a death at once (the watch polls every 0.5 s).
    assert took < (STALL_S + 5 if fault == "hang" else 5), took
    assert t.final is not None
    assert t.final["type"] == "chat.done", t.frames
    # The next attempt continued the answer (ADR 0071): no reset, the whole answer once.
    assert t.resets == [], t.frames
    shown = [f for f in t.frames if f["type"] == "chat.delta"]
    assert [f["seq"] for f in shown] == list(range(len(shown)))
    whole = complete(request["prompt"], MAX_TOKENS, ignore_eos=True)
    assert "".join(f["text"] for f in shown) == whole.text
    assert t.final["usage"]["completion_tokens"] == whole.completion_tokens == MAX_TOKENS
    assert [f["type"] for f in t.frames].count("chat.done") == 1
    # Started again, as its supervisor would: it serves once more.
    stack.processes.pop(sick)
    stack.start_service("worker", sick, **stack.workers[sick])
    wait_until(lambda: ready(stack, sick), 60, f"{sick} ready again")


def ready(stack: Stack, worker: str) -> bool:
    assert worker not in stack.exited()
    try:
        status, _ = stack.health(worker, "/readyz")
    except OSError:  # not listening yet
        return False
    return status == 200
