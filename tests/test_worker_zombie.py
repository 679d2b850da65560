"""On the real stack: a worker paused past its missed beats (a zombie), and dead workers.

SIGSTOP a worker mid-stream: the schedulers declare it dead and re-run its requests on the
other worker. SIGCONT it: it notices the silence, fences itself and stops its stale runs
without writing, and what it had written is superseded. The client sees one complete,
exact answer per request, at most one `chat.reset` per re-run, nothing after `chat.done`.
A worker killed for good leaves the scheduler's registry; restarted, it registers afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.chat_client import ChatSession, check_complete
from tests.factories import long_prompts
from tests.stack import Stack, announces, new_prefix, wait_until
from tests.worker_logs import events, reruns

WORKER_A, WORKER_B = "worker-a", "worker-b"


@pytest.fixture(scope="module")
def zombie_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_ID": WORKER_A,
            # Streams of 60+ tokens take 3 s or more: mid-stream when the worker stops.
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": "20",
            # Dead after 1.5 s of silence; a worker fences itself at the same threshold.
            "TOKENBUS_WORKER_HEARTBEAT_MS": "300",
            "TOKENBUS_SCHEDULER_WORKER_MISSED_BEATS": "5",
            "TOKENBUS_WORKER_FENCE_MISSED_BEATS": "5",
            "TOKENBUS_SCHEDULER_RECOVERY_GRACE_MS": "300",
            # One request per batch, so requests spread over both workers.
            "TOKENBUS_SCHEDULER_INTERACTIVE_MAX_BATCH_SIZE": "1",
        },
    )
    try:
        s.start()
        start_worker_b(s)
        wait_until(lambda: s.workers_heard() >= {WORKER_A, WORKER_B}, 60, "both workers' beats")
        yield s
    finally:
        for proc in s.processes.values():  # a test that failed midway may leave one stopped
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
        s.stop()


def start_worker_b(stack: Stack, **env: str) -> None:
    stack.start_service(
        "worker",
        key=WORKER_B,
        TOKENBUS_WORKER_ID=WORKER_B,
        TOKENBUS_WORKER_BATCH_PARTITION="1",
        **env,
    )


def of_worker(stack: Stack, key: str, event: str, worker_id: str) -> list[dict[str, Any]]:
    return [e for e in events(stack.log(key), event) if e.get("worker_id") == worker_id]


async def quiet(ws: websockets.ClientConnection, seconds: float) -> list[dict[str, Any]]:
    """Frames that arrive within `seconds` (there should be none once every stream ended)."""
    late: list[dict[str, Any]] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while True:
                late.append(json.loads(await ws.recv()))
    return late


async def pause_worker_b_mid_stream(
    stack: Stack, tag: str
) -> tuple[list[dict[str, Any]], ChatSession, list[dict[str, Any]]]:
    """Requests under way on both workers; B stopped until declared dead, then woken.

    Returns the requests, their transcripts, and frames that came after every stream ended.
    """
    b = stack.processes[WORKER_B]
    async with websockets.connect(stack.ws_url) as ws:
        requests, session = await wave_on_both_workers(stack, ws, tag)
        recovered = len(of_worker(stack, "scheduler", "worker.recovered", WORKER_B))
        os.killpg(b.pid, signal.SIGSTOP)
        try:
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    len(of_worker(stack, "scheduler", "worker.recovered", WORKER_B)) > recovered
                ),
                30,
                "worker B declared dead and its requests handed back",
            )
        finally:
            # Woken while the other worker re-runs its requests: its stale runs could race.
            os.killpg(b.pid, signal.SIGCONT)
        await session.until(session.all_ended, within=60)
        late = await quiet(ws, 2.0)
    return requests, session, late


WAVES = 3  # tries at a wave that lands on both workers


async def wave_on_both_workers(
    stack: Stack, ws: websockets.ClientConnection, tag: str
) -> tuple[list[dict[str, Any]], ChatSession]:
    """Eight long streams under way, some on each worker: the premise of the pause tests.

    Least-loaded placement spreads a wave over both workers only while the scheduler holds
    fresh beats of both; on a loaded machine one may be a beat late, and the whole wave goes
    to the other (CI, 2 Dec: all 8 on B). Such a wave is let finish and a new one is sent:
    where the requests go is not what these tests check, what happens to them is.
    """
    placed: set[str] = set()
    for wave in range(WAVES):
        dispatched = len(events(stack.log("scheduler"), "batch.dispatched"))
        requests: list[dict[str, Any]] = [
            {"client_id": f"{tag}{wave}-{i}", "prompt": prompt, "max_tokens": 500}
            for i, prompt in enumerate(long_prompts(8, 60, f"pause the worker {tag}{wave}"))
        ]
        session = ChatSession(ws)
        for request in requests:
            await session.send(request)
        await session.until(lambda s=session: all(t.deltas for t in s.by_client.values()), 60)
        wave_batches = events(stack.log("scheduler"), "batch.dispatched")[dispatched:]
        placed = {e["worker_id"] for e in wave_batches}
        if placed >= {WORKER_A, WORKER_B}:
            return requests, session
        await session.until(session.all_ended, within=60)
    raise AssertionError(f"{WAVES} waves of 8 all went to one worker: {sorted(placed)}")


def check_one_answer_each(
    stack: Stack,
    requests: list[dict[str, Any]],
    session: ChatSession,
    late: list[dict[str, Any]],
) -> list[str]:
    """Every client saw one complete, exact answer, with no `chat.reset`: a re-run continues
    the answer it takes over (ADR 0071); return the ids of those re-run."""
    assert late == [], late  # nothing after chat.done, from anyone
    ours = {t.request_id for t in session.by_client.values()}
    # Worker A's process is the stack's "worker".
    moved = reruns([stack.log("worker"), stack.log(WORKER_B)]) & ours
    assert moved, "worker B held none of the requests: the test proved nothing"
    assert len(moved) < len(requests), "worker A should have run some at their first attempt"
    for request in requests:
        t = session.by_client[request["client_id"]]
        check_complete(t, request)  # one done, last; the text is the exact uninterrupted one
        assert t.resets == [], t.frames
    return sorted(moved)


async def test_a_paused_worker_declared_dead_is_fenced_when_it_wakes(zombie_stack: Stack) -> None:
    stack = zombie_stack
    b = stack.processes[WORKER_B]
    requests, session, late = await pause_worker_b_mid_stream(stack, "z")
    await asyncio.to_thread(
        wait_until,
        lambda: of_worker(stack, WORKER_B, "worker.fenced", WORKER_B),
        30,
        "worker B to fence itself",
    )
    moved = check_one_answer_each(stack, requests, session, late)
    recovered = of_worker(stack, "scheduler", "worker.recovered", WORKER_B)
    assert recovered[0]["handed_back"] == len(moved)
    # The woken worker lives on; its stale runs stopped without finishing.
    assert b.poll() is None
    [fenced] = of_worker(stack, WORKER_B, "worker.fenced", WORKER_B)
    assert fenced["silent_s"] > 1.5
    assert fenced["running"] == len(moved)
    moved_ids = set(moved)
    # (Back as a new incarnation, it may run some of the re-runs: attempt 1.)
    stale = [e for e in events(stack.log(WORKER_B), "request.finished") if e["attempt"] == 0]
    finished_on_b = {e["request_id"] for e in stale}
    assert not moved_ids & finished_on_b
    stopped = events(stack.log(WORKER_B), "request.stopped_for_hand_back")
    stopped += events(stack.log(WORKER_B), "request.stopped_for_rerun")
    assert {e["request_id"] for e in stopped} == moved_ids
    # It came back as a new incarnation, and serves again.
    registered = of_worker(stack, "scheduler", "worker.registered", WORKER_B)
    assert len({e["started_at"] for e in registered}) >= 2
    more: list[dict[str, Any]] = [
        {"client_id": f"m{i}", "prompt": f"after the pause {i}", "max_tokens": 6} for i in range(6)
    ]
    async with websockets.connect(stack.ws_url) as ws:
        session = ChatSession(ws)
        for request in more:
            await session.send(request)
        await session.until(session.all_ended, within=60)
    for request in more:
        check_complete(session.by_client[request["client_id"]], request)


async def test_a_dead_worker_leaves_the_registry_and_registers_afresh_when_restarted(
    zombie_stack: Stack,
) -> None:
    stack = zombie_stack
    await asyncio.to_thread(stack.stop_service, WORKER_B, signal.SIGKILL)
    # Declared dead, recovered, swept once more (10 s later), then forgotten.
    await asyncio.to_thread(
        wait_until,
        lambda: of_worker(stack, "scheduler", "worker.forgotten", WORKER_B),
        60,
        "worker B forgotten",
    )
    [forgotten] = of_worker(stack, "scheduler", "worker.forgotten", WORKER_B)
    assert forgotten["registered"] == 1  # only worker A is left in the registry
    before = len(of_worker(stack, "scheduler", "worker.registered", WORKER_B))
    ran_before = len(events(stack.log(WORKER_B), "request.finished"))
    # Restarted without self-fencing, for the next test.
    start_worker_b(stack, TOKENBUS_WORKER_FENCE_MISSED_BEATS="1000")
    await asyncio.to_thread(
        wait_until,
        lambda: len(of_worker(stack, "scheduler", "worker.registered", WORKER_B)) > before,
        60,
        "worker B registered again",
    )
    assert of_worker(stack, "scheduler", "worker.registered", WORKER_B)[-1]["registered"] == 2
    requests: list[dict[str, Any]] = [
        {"client_id": f"r{i}", "prompt": f"back again {i}", "max_tokens": 30} for i in range(6)
    ]
    async with websockets.connect(stack.ws_url) as ws:
        session = ChatSession(ws)
        for request in requests:
            await session.send(request)
        await session.until(session.all_ended, within=60)
    for request in requests:
        check_complete(session.by_client[request["client_id"]], request)
    # The restarted worker took its share.
    assert len(events(stack.log(WORKER_B), "request.finished")) > ran_before


async def test_without_self_fencing_the_reset_records_alone_hide_what_a_zombie_writes(
    zombie_stack: Stack,
) -> None:
    """Worker B (restarted above) never fences itself: it wakes and writes on.

    The scheduler's `reset` records, written before the re-runs, make the edge drop all of
    it: the client sees the re-run's answer only.
    """
    stack = zombie_stack
    recovered_before = len(of_worker(stack, "scheduler", "worker.recovered", WORKER_B))
    requests, session, late = await pause_worker_b_mid_stream(stack, "n")
    moved = check_one_answer_each(stack, requests, session, late)
    recovered = of_worker(stack, "scheduler", "worker.recovered", WORKER_B)[recovered_before:]
    assert recovered[0]["handed_back"] == len(moved)
    assert not of_worker(stack, WORKER_B, "worker.fenced", WORKER_B)[1:]  # only test 1's
    assert stack.processes[WORKER_B].poll() is None
    # The zombie did write its stale attempt after the reset that superseded it.
    stale_after_reset = 0
    log = await result_log(stack)
    for t in session.by_client.values():
        if t.request_id not in moved:
            continue
        records = log[t.request_id]
        resets_at = [i for i, r in enumerate(records) if announces(r)]
        assert len(resets_at) == 1, records
        before, after = records[: resets_at[0]], records[resets_at[0] :]
        stale_after_reset += sum(1 for r in after if r["attempt"] == 0)
        # The re-run continued what attempt 0 had written before the reset: its first delta
        # is that text (the client was shown the exact answer once: check_one_answer_each).
        written = "".join(r["text"] for r in before if r["kind"] == "delta")
        first = next(r for r in after if r["attempt"] == 1 and r["kind"] == "delta")
        assert (first["seq"], first["text"]) == (0, written), records
    assert stale_after_reset > 0, "worker B wrote nothing after waking: the test proved nothing"


async def result_log(stack: Stack) -> dict[str, list[dict[str, Any]]]:
    """Every result record on the shared results topic, per request, in log order."""
    topic = stack.topics.results
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(stack.topics.partitions()[topic])]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: dict[str, list[dict[str, Any]]] = {}
        todo = {tp for tp in tps if ends[tp] > 0}
        while todo:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    value = json.loads(r.value or b"{}")
                    out.setdefault(value["request_id"], []).append(value)
            todo = {tp for tp in todo if await consumer.position(tp) < ends[tp]}
        return out
    finally:
        await consumer.stop()
