"""Result streams end to end, in both topologies: resume on any edge, exactly-once display,
cancel after the disconnect grace period. Two edge processes on the real broker.

On the session's shared stack: the two edges are the module's own, with the settings it tests
(the topology, the grace period, a short lease), and every prompt is paced to 20 tokens a
second by the sim's pace marker."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import websockets
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin.records_to_delete import RecordsToDelete

from services.edge.resume import ResumeClaims, sign, verify
from services.worker.engines.sim_text import complete
from shared.kafka import encode, key_of, make_admin, make_producer
from shared.messages import (
    CancelRecord,
    DeltaResult,
    DoneResult,
    ErrorResult,
    ResultRecord,
    Timings,
    Usage,
)
from tests.chat_client import recv_json
from tests.stack import Stack, wait_until
from tests.tenants import paced

TOKEN_RATE = 20  # sim tokens/s: a delta every 50 ms, so "read 5 then kill" is easy
GRACE_S = 3.0
# The module's edges' own settings: the topology is each run's.
EDGE_ENV = {
    "TOKENBUS_EDGE_DISCONNECT_GRACE_S": str(GRACE_S),
    "TOKENBUS_EDGE_LEASE_TTL_S": "3",
    "TOKENBUS_EDGE_RESULT_TOPIC_RETENTION_S": "30",
}

Frame = dict[str, Any]


@dataclass
class TwoEdges:
    stack: Stack
    key_a: str
    port_a: int
    port_b: int
    env: dict[str, str]

    @property
    def url_a(self) -> str:
        return self.stack.ws_url_as("default", port=self.port_a)

    @property
    def url_b(self) -> str:
        return self.stack.ws_url_as("default", port=self.port_b)


@pytest.fixture(scope="module", params=["partition", "topic"])
def edges(request: pytest.FixtureRequest, stack: Stack) -> Iterator[TwoEdges]:
    env = {**EDGE_ENV, "TOKENBUS_EDGE_RESULT_TOPOLOGY": request.param}
    key = f"edge-streams-{request.param}"
    with stack.own_edge(f"{key}-a", **env) as port_a, stack.own_edge(f"{key}-b", **env) as port_b:
        yield TwoEdges(stack, f"{key}-a", port_a, port_b, env)


def expected_text(prompt: str, max_tokens: int) -> str:
    return complete(prompt, max_tokens).text


async def submit(ws: websockets.ClientConnection, prompt: str, max_tokens: int) -> Frame:
    request = {"type": "chat.request", "client_id": "c", "prompt": prompt, "max_tokens": max_tokens}
    await ws.send(json.dumps(request))
    frame = await recv_json(ws)
    assert frame["type"] == "chat.accepted", frame
    return frame


async def read_deltas(ws: websockets.ClientConnection, n: int) -> list[Frame]:
    deltas: list[Frame] = []
    while len(deltas) < n:
        frame = await recv_json(ws)
        assert frame["type"] == "chat.delta", frame
        deltas.append(frame)
    return deltas


async def read_to_end(ws: websockets.ClientConnection) -> list[Frame]:
    frames: list[Frame] = []
    while not frames or frames[-1]["type"] not in ("chat.done", "error"):
        frames.append(await recv_json(ws, 60))
    return frames


async def resume(url: str, token: str, after_seq: int, **headers: str) -> list[Frame]:
    async with websockets.connect(url, additional_headers=headers) as ws:
        await ws.send(
            json.dumps({"type": "stream.resume", "resume_token": token, "after_seq": after_seq})
        )
        return await read_to_end(ws)


def check_continuation(before: list[Frame], after: list[Frame], prompt: str, n: int) -> None:
    """The frames after a resume continue `before` exactly: no gap, no repeat, same text."""
    assert after[0]["type"] == "stream.resumed", after
    deltas = [f for f in after if f["type"] == "chat.delta"]
    assert [f["type"] for f in after] == ["stream.resumed"] + ["chat.delta"] * len(deltas) + [
        "chat.done"
    ], after
    seqs = [d["seq"] for d in before + deltas]
    assert seqs == list(range(len(seqs))), seqs
    text = "".join(d["text"] for d in before + deltas)
    plan = complete(prompt, n)
    assert text == plan.text
    assert after[-1]["usage"]["completion_tokens"] == plan.completion_tokens, "ran to the end"


def claims_of(stack: Stack, token: str) -> ResumeClaims:
    return verify(token, stack.resume_keys, now=time.time())


async def read_results(
    bootstrap: str, claims: ResumeClaims, until: type, within_s: float = 30
) -> list[tuple[float, ResultRecord]]:
    """(broker timestamp s, record) of one request, from its token's offset to `until`."""
    from pydantic import TypeAdapter

    adapter: TypeAdapter[ResultRecord] = TypeAdapter(ResultRecord)
    tp = TopicPartition(claims.topic, claims.partition or 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    out: list[tuple[float, ResultRecord]] = []
    try:
        consumer.assign([tp])
        consumer.seek(tp, claims.offset)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=500)
            for record in batch.get(tp, []):
                result = adapter.validate_json(record.value or b"")
                if result.request_id == claims.request_id:
                    out.append((record.timestamp / 1000, result))
                    if isinstance(result, until):
                        return out
        raise AssertionError(f"no {until.__name__} for {claims.request_id} in {within_s} s")
    finally:
        await consumer.stop()


# -- acceptance 1: resume after kill -9 on another edge, and on the same edge ------------------


async def test_resume_on_edge_b_after_edge_a_is_killed(edges: TwoEdges) -> None:
    prompt, n = paced("resume after a crash", TOKEN_RATE), 40
    stack = edges.stack
    try:
        async with websockets.connect(edges.url_a) as ws:
            accepted = await submit(ws, prompt, n)
            before = await read_deltas(ws, 5)
            stack.stop_service(edges.key_a, signal.SIGKILL)
        after = await resume(edges.url_b, accepted["resume_token"], before[-1]["seq"])
        check_continuation(before, after, prompt, n)
    finally:
        if stack.processes[edges.key_a].poll() is not None:
            port = str(edges.port_a)
            stack.start_service("edge", key=edges.key_a, TOKENBUS_EDGE_PORT=port, **edges.env)
            wait_until(lambda: stack.edge_ready(edges.port_a), 60, "edge A back")


async def test_clean_disconnect_then_resume_on_the_same_edge(edges: TwoEdges) -> None:
    prompt, n = paced("resume on the same edge", TOKEN_RATE), 30
    async with websockets.connect(edges.url_a) as ws:
        accepted = await submit(ws, prompt, n)
        before = await read_deltas(ws, 5)
    after = await resume(edges.url_a, accepted["resume_token"], before[-1]["seq"])
    check_continuation(before, after, prompt, n)


async def test_resume_elsewhere_stops_the_first_edges_grace_cancel(edges: TwoEdges) -> None:
    # Runs past edge A's grace period: A must learn that B serves the stream now.
    n = int(TOKEN_RATE * GRACE_S * 3)
    prompt = paced("please outlive the grace period", TOKEN_RATE)
    assert complete(prompt, n).completion_tokens > TOKEN_RATE * (GRACE_S + 1)
    async with websockets.connect(edges.url_a) as ws:
        accepted = await submit(ws, prompt, n)
        before = await read_deltas(ws, 3)
    after = await resume(edges.url_b, accepted["resume_token"], before[-1]["seq"])
    check_continuation(before, after, prompt, n)


# -- acceptance 2: duplicates and superseded attempts, injected into the result topic ---------


async def test_injected_duplicates_and_old_attempt_records_are_never_shown(
    edges: TwoEdges,
) -> None:
    n = int(TOKEN_RATE * 10)  # the worker's attempt 0 keeps writing while we inject
    stack = edges.stack
    producer = make_producer(stack.settings, client_id="injector")
    await producer.start()
    try:
        async with websockets.connect(edges.url_a) as ws:
            prompt = paced("please outlive the grace period", TOKEN_RATE)
            accepted = await submit(ws, prompt, n)
            shown = await read_deltas(ws, 2)
            claims = claims_of(stack, accepted["resume_token"])
            rid = claims.request_id

            async def inject(record: DeltaResult | DoneResult) -> None:
                await producer.send_and_wait(
                    claims.topic, encode(record), key=key_of(rid), partition=claims.partition
                )

            for seq in (0, 1):  # replays of what was shown, same (attempt, seq)
                await inject(DeltaResult(request_id=rid, attempt=0, seq=seq, text="DUPLICATE"))
            await inject(DeltaResult(request_id=rid, attempt=1, seq=0, text="second try. "))
            await inject(DeltaResult(request_id=rid, attempt=1, seq=0, text="DUPLICATE"))
            await inject(DeltaResult(request_id=rid, attempt=1, seq=1, text="it works."))
            # Let the worker write attempt-0 records after the reset before the end.
            await asyncio.sleep(5 / TOKEN_RATE)  # five token times of the old attempt
            usage = Usage(prompt_tokens=4, completion_tokens=2)
            timings = Timings(queue_ms=0, batch_size=1, ttft_ms=1, total_ms=1)
            end = {"finish_reason": "stop", "usage": usage, "timings": timings}
            await inject(DoneResult(request_id=rid, attempt=1, seq=2, **end))
            rest = await read_to_end(ws)
    finally:
        await producer.send_and_wait(
            stack.topics.control, encode(CancelRecord(request_id=rid)), key=key_of(rid)
        )
        await producer.stop()

    frames = shown + rest
    assert all(f.get("text") != "DUPLICATE" for f in frames), frames
    resets = [i for i, f in enumerate(frames) if f["type"] == "chat.reset"]
    assert len(resets) == 1, frames
    assert frames[resets[0]]["attempt"] == 1
    old, new = frames[: resets[0]], frames[resets[0] + 1 :]
    old_seqs = [f["seq"] for f in old]
    assert old_seqs == list(range(len(old_seqs)))
    assert [(f["type"], f.get("text")) for f in new] == [
        ("chat.delta", "second try. "),
        ("chat.delta", "it works."),
        ("chat.done", None),
    ]
    # The worker did write attempt-0 records after the reset: they were there to be dropped.
    log = await read_results(stack.bootstrap, claims, DoneResult)
    reset_at = next(i for i, (_, r) in enumerate(log) if r.attempt == 1)
    assert any(r.attempt == 0 for _, r in log[reset_at:]), "no old-attempt record came late"


# -- acceptance 4: a dropped socket's request is cancelled after the grace period -------------


async def test_dropped_socket_without_resume_is_cancelled_after_the_grace_period(
    edges: TwoEdges,
) -> None:
    n = int(TOKEN_RATE * GRACE_S * 3)
    async with websockets.connect(edges.url_a) as ws:
        accepted = await submit(ws, paced("nobody comes back slowly", TOKEN_RATE), n)
        await read_deltas(ws, 2)
    dropped_at = time.time()
    claims = claims_of(edges.stack, accepted["resume_token"])
    log = await read_results(edges.stack.bootstrap, claims, ErrorResult, within_s=GRACE_S + 20)
    cancelled_at, final = log[-1]
    assert isinstance(final, ErrorResult)
    assert final.code == "cancelled"
    waited = cancelled_at - dropped_at
    assert GRACE_S - 0.25 <= waited <= GRACE_S + 5, f"cancelled {waited:.2f} s after the drop"
    plan = complete(paced("nobody comes back slowly", TOKEN_RATE), n)
    assert plan.completion_tokens > TOKEN_RATE * (GRACE_S + 1), "the answer must outlast the grace"
    deltas = [r for _, r in log if isinstance(r, DeltaResult)]
    assert len(deltas) < plan.completion_tokens, "the worker stopped before the natural end"


async def test_chat_cancel_is_immediate(edges: TwoEdges) -> None:
    async with websockets.connect(edges.url_a) as ws:
        prompt = paced("cancel me now please", TOKEN_RATE)
        accepted = await submit(ws, prompt, int(TOKEN_RATE * 10))
        await read_deltas(ws, 1)
        await ws.send(json.dumps({"type": "chat.cancel", "request_id": accepted["request_id"]}))
        started = time.monotonic()
        frames = await read_to_end(ws)
    assert frames[-1]["type"] == "error"
    assert frames[-1]["code"] == "cancelled"
    assert time.monotonic() - started < GRACE_S / 2


# -- refusals: never a stream with a gap, never another tenant's stream -----------------------


async def test_resume_refusals(edges: TwoEdges) -> None:
    stack = edges.stack
    prompt, n = paced("short and done", TOKEN_RATE), 4
    alice, mallory = stack.keys["alice"], stack.keys["mallory"]
    url_a, url_b = stack.ws_url_as(None, edges.port_a), stack.ws_url_as(None, edges.port_b)
    async with websockets.connect(
        url_a, additional_headers={"Authorization": f"Bearer {alice}"}
    ) as ws:
        accepted = await submit(ws, prompt, n)
        frames = await read_to_end(ws)
    assert frames[-1]["type"] == "chat.done"
    token = accepted["resume_token"]
    claims = claims_of(stack, token)

    # The owner may replay it whole, on either edge.
    for url in (url_a, url_b):
        whole = await resume(url, token, -1, Authorization=f"Bearer {alice}")
        assert "".join(f.get("text", "") for f in whole) == expected_text(prompt, n)

    async def refused(tok: str, after_seq: int = -1, key: str = alice) -> str:
        frames = await resume(url_b, tok, after_seq, Authorization=f"Bearer {key}")
        assert len(frames) == 1, frames
        assert frames[0]["type"] == "error", frames
        return str(frames[0]["code"])

    assert await refused(token, key=mallory) == "unauthorized"
    assert await refused(token[:-3] + ("AAA" if token[-3:] != "AAA" else "BBB")) == "unauthorized"
    expired = claims.model_copy(update={"expires_at": time.time() - 1})
    assert await refused(sign(expired, stack.resume_keys)) == "not_found"
    assert await refused(token, after_seq=n + 5) == "invalid_request"

    # Truncated: the stream's records are gone from the log.
    tp = TopicPartition(claims.topic, claims.partition or 0)
    admin = make_admin(stack.settings)
    await admin.start()
    try:
        consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap)
        await consumer.start()
        try:
            end = (await consumer.end_offsets([tp]))[tp]
        finally:
            await consumer.stop()
        await admin.delete_records({tp: RecordsToDelete(before_offset=end)})
    finally:
        await admin.close()
    assert await refused(token) == "not_found"
    gone = claims.model_copy(update={"topic": f"{stack.topics.results}.{'0' * 32}"})
    assert await refused(sign(gone, stack.resume_keys)) == "not_found"
