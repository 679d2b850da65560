"""Resume and cancel are not free (issue 24, finding "resume and cancel are free").

The attacker holds one valid key and sends what a script would: the same `stream.resume`
or `chat.cancel` frame over and over on a real WebSocket to a real edge. On main (456a15c)
every resume wrote a record to `tokenbus.control` (read by every edge and worker) and
rewound the edge's shared results partition, and a resume of a stream the socket already
read replayed it from the start, so the client was shown every delta twice; every cancel
wrote another control record. Now each is charged to the tenant's request rate, a resume of
an attached stream and a second cancel are no-ops, and a replay reads with a consumer of its
own (the shared reader's count of records read does not grow by what a resume replays).

Resumes far back (issue 37, N8): before ed90684 one resume could read
200,000 records, any tenant could start every one of the edge's 16 replay readers, and what a
replay read cost its tenant nothing. Now a tenant's replays read at most `replays` result
partitions at once (past it `overloaded`), and each is charged a request per 10,000 records
it read; `test_resumes_far_back_hold_one_replay_place_are_charged_and_leave_others_flowing`
sends that attack, from behind 40,000 records of others' traffic, and times a victim beside it.

On the session's shared stack: its tenants have their own limits there (`tests/tenants.py`,
`RESUME_AND_CANCEL`), it talks to two edges of its own, and its answers are paced to 40 tokens
a second by the sim's pace marker.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import websockets

from services.edge.quotas import SCANNED_PER_REQUEST
from shared.kafka import make_producer
from shared.messages import DeltaFrames
from tests.chat_client import recv_json
from tests.stack import Stack, read_records
from tests.tenants import RESUME_ATTACKER_RPS, paced

ATTACKER_RPS = RESUME_ATTACKER_RPS  # burst 4: ceil(rps)
ATTACKER, ONE_STREAM = "flood-attacker", "flood-one-stream"  # tests/tenants.py
FLOOD = 40
SLOW_TOKEN_RATE = 40  # tokens/s: a 120-token answer streams for 3 s


@dataclass(frozen=True)
class Edges:
    """The module's two edges of the session's shared stack, by port: their gauges and
    shared readers count only this module's streams."""

    a: int
    b: int


@pytest.fixture(scope="module")
def edges(stack: Stack) -> Iterator[Edges]:
    with stack.own_edge("edge-flood-a") as a, stack.own_edge("edge-flood-b") as b:
        yield Edges(a, b)


async def _control_records(stack: Stack, request_id: str) -> list[dict[str, Any]]:
    records = [json.loads(v) for v in await stack.read_async(stack.topics.control)]
    return [r for r in records if r.get("request_id") == request_id]


async def _open(ws: websockets.ClientConnection, max_tokens: int) -> dict[str, Any]:
    await ws.send(
        json.dumps(
            {
                "type": "chat.request",
                "client_id": "c",
                "prompt": paced(f"resume flood {time.monotonic_ns()}", SLOW_TOKEN_RATE),
                "max_tokens": max_tokens,
            }
        )
    )
    accepted = await recv_json(ws)
    assert accepted["type"] == "chat.accepted", accepted
    return accepted


async def _until_final(ws: websockets.ClientConnection, frames: list[dict[str, Any]]) -> None:
    """Frames until the stream's final one: `chat.done`, or an error that ends it (a
    `rate_limited` answer to a flood frame does not)."""
    while True:
        frame = await recv_json(ws)
        frames.append(frame)
        if frame["type"] == "chat.done":
            return
        if frame["type"] == "error" and frame.get("code") not in ("rate_limited", None):
            return


async def _drain(ws: websockets.ClientConnection, frames: list[dict[str, Any]], s: float) -> None:
    """Whatever else the edge sends within `s` seconds (the answers to a flood)."""
    deadline = time.monotonic() + s
    while (left := deadline - time.monotonic()) > 0:
        try:
            frames.append(await recv_json(ws, timeout=left))
        except TimeoutError:
            return


def test_a_resume_flood_is_rate_limited_and_writes_no_more_than_the_burst(
    stack: Stack, edges: Edges
) -> None:
    async def attack() -> None:
        async with websockets.connect(stack.ws_url_as(ATTACKER, edges.a)) as ws:
            accepted = await _open(ws, max_tokens=4)
            frames: list[dict[str, Any]] = []
            await _until_final(ws, frames)
            resume = {"type": "stream.resume", "resume_token": accepted["resume_token"]}
            for _ in range(FLOOD):
                await ws.send(json.dumps(resume))
            await _drain(ws, frames, 4.0)
        limited = [f for f in frames if f.get("code") == "rate_limited"]
        assert len(limited) >= FLOOD - 2 * ATTACKER_RPS, [f["type"] for f in frames]
        assert all(f.get("retry_after_ms") for f in limited)
        resumed = await _control_records(stack, accepted["request_id"])
        resumed = [r for r in resumed if r.get("kind") == "resumed"]
        # The request took one unit of the burst; what is left, plus the refill in the
        # drain window, is all a flood of 40 gets written.
        assert len(resumed) <= 2 * ATTACKER_RPS, len(resumed)

    asyncio.run(attack())


def test_resuming_a_stream_the_socket_already_reads_shows_nothing_twice(
    stack: Stack, edges: Edges
) -> None:
    async def attack() -> None:
        async with websockets.connect(stack.ws_url_as("default", edges.a)) as ws:
            accepted = await _open(ws, max_tokens=120)
            resume = {"type": "stream.resume", "resume_token": accepted["resume_token"]}
            frames: list[dict[str, Any]] = []
            first = await recv_json(ws)
            frames.append(first)
            for _ in range(3):
                await ws.send(json.dumps(resume))
            await _until_final(ws, frames)
        deltas = [f["seq"] for f in frames if f["type"] == "chat.delta"]
        assert deltas == sorted(set(deltas)), "a delta was shown twice"
        assert not [f for f in frames if f["type"] == "stream.resumed"]
        control = await _control_records(stack, accepted["request_id"])
        assert not [r for r in control if r.get("kind") == "resumed"], control

    asyncio.run(attack())


def test_a_cancel_flood_writes_one_cancel_record(stack: Stack, edges: Edges) -> None:
    async def attack() -> None:
        async with websockets.connect(stack.ws_url_as("default", edges.a)) as ws:
            accepted = await _open(ws, max_tokens=120)
            cancel = {"type": "chat.cancel", "request_id": accepted["request_id"]}
            for _ in range(FLOOD):
                await ws.send(json.dumps(cancel))
            frames: list[dict[str, Any]] = []
            await _until_final(ws, frames)
        request_id = accepted["request_id"]
        cancels = [r for r in await _control_records(stack, request_id) if r["kind"] == "cancel"]
        assert len(cancels) == 1, cancels

    asyncio.run(attack())


def _metric(stack: Stack, name: str) -> float:
    text = stack.edge_metrics("edge-flood-a")
    values = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} not on the edge's /metrics"
    return float(values[0])


def test_a_resume_replays_with_its_own_reader_and_never_rewinds_the_shared_one(
    stack: Stack, edges: Edges
) -> None:
    async def attack() -> tuple[int, list[int]]:
        async with websockets.connect(stack.ws_url_as("alice", edges.a)) as ws:
            accepted = await _open(ws, max_tokens=4)
            await _until_final(ws, [])
        # Others' streams fill the edge's shared partition after the token's offset.
        behind = 0
        async with websockets.connect(stack.ws_url_as("default", edges.a)) as ws:
            for _ in range(4):
                await _open(ws, max_tokens=60)
                frames: list[dict[str, Any]] = []
                await _until_final(ws, frames)
                behind += len(frames)
        replays = []
        for _ in range(3):
            async with websockets.connect(stack.ws_url_as("alice", edges.a)) as ws:
                resume = {"type": "stream.resume", "resume_token": accepted["resume_token"]}
                await ws.send(json.dumps(resume))
                frames = []
                await _until_final(ws, frames)
                replays.append(len([f for f in frames if f["type"] == "chat.delta"]))
        return behind, replays

    read_before = _metric(stack, "tokenbus_edge_results_read_total")
    replayed_before = _metric(stack, "tokenbus_edge_resume_replay_records_total")
    behind, replays = asyncio.run(attack())
    assert replays == [4, 4, 4]  # each resume showed the whole stream again
    read = _metric(stack, "tokenbus_edge_results_read_total") - read_before
    replayed = _metric(stack, "tokenbus_edge_resume_replay_records_total") - replayed_before
    # The shared reader read the new records once (the five streams: ~250); three rewinds to
    # the first stream's offset would have read them three more times.
    assert read < 2 * behind, (read, behind)
    assert replayed >= 3 * behind, (replayed, behind)


def test_a_stream_resumed_on_another_edge_takes_a_concurrency_slot_there(
    stack: Stack, edges: Edges
) -> None:
    """ONE_STREAM may run one stream at once; resuming a second one on another edge is refused."""

    async def attack() -> list[dict[str, Any]]:
        async with websockets.connect(stack.ws_url_as(ONE_STREAM, edges.a)) as ws:
            first = await _open(ws, max_tokens=120)  # edge A's one slot; the socket drops
        async with websockets.connect(stack.ws_url_as(ONE_STREAM, edges.b)) as ws:
            await _open(ws, max_tokens=120)  # edge B's one slot
            resume = {"type": "stream.resume", "resume_token": first["resume_token"]}
            await ws.send(json.dumps(resume))
            frames: list[dict[str, Any]] = []
            while not [f for f in frames if f["type"] in ("error", "stream.resumed")]:
                frames.append(await recv_json(ws))
            return frames

    frames = asyncio.run(attack())
    refused = [f for f in frames if f["type"] == "error"]
    assert refused, frames
    assert refused[0]["code"] == "rate_limited", frames
    assert "concurrency" in refused[0]["message"]


# Resumes far back (issue 37, N8).
REPLAY_ATTACKER, VICTIM = "replay-attacker", "replay-victim"  # tests/tenants.py
FAR_BACK = 4 * SCANNED_PER_REQUEST  # others' records behind each stream: four requests' charge
VICTIMS = 8  # a victim's requests timed at once, idle and beside the attack


async def _partition_of(stack: Stack, request_id: str) -> int:
    """The results partition a stream's records are on (its edge's)."""
    topic = stack.topics.results
    records = await read_records(stack.settings, topic, stack.topics.partitions()[topic])
    partitions: set[int] = {r.partition for r in records if r.key == request_id.encode()}
    (partition,) = partitions
    return partition


async def _others_traffic(stack: Stack, partition: int, count: int) -> None:
    """`count` result records of a stream nobody reads, written after every stream so far:
    what a resume of those streams must read past (an edge's busy partition)."""
    producer = make_producer(stack.settings, client_id="replay-traffic")
    await producer.start()
    try:
        other = f"others-{uuid.uuid4().hex[:12]}"
        frames = DeltaFrames(other, attempt=0)  # the bytes a worker writes, made as it does
        sent = [
            await producer.send(
                stack.topics.results,
                frames.encode(seq, " word"),
                key=other.encode(),
                partition=partition,
            )
            for seq in range(count)
        ]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


async def _resume(url: str, token: str) -> list[dict[str, Any]]:
    """A resume on a socket of its own: its frames to the stream's end, or to a refusal."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "stream.resume", "resume_token": token}))
        frames: list[dict[str, Any]] = []
        await _until_final(ws, frames)
        return frames


async def _ttfts(url: str, n: int) -> list[float]:
    """`n` requests at once, each on its socket: seconds from each send to its first delta."""

    async def one(i: int) -> float:
        async with websockets.connect(url) as ws:
            began = time.monotonic()
            await ws.send(
                json.dumps({"type": "chat.request", "prompt": f"victim {i}", "max_tokens": 2})
            )
            while (await recv_json(ws))["type"] != "chat.delta":
                pass
            return time.monotonic() - began

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def test_resumes_far_back_hold_one_replay_place_are_charged_and_leave_others_flowing(
    stack: Stack, edges: Edges
) -> None:
    """The attacker (one replay place, a request a second) has a stream on each edge's
    partition, each behind 40,000 records of others' traffic, and resumes both at once on
    edge A. One replay runs, the other is refused `overloaded` (the tenant's one place is
    taken); the one that ran is charged four requests, so the attacker's next request waits
    them out; and a victim's requests on the same edge meanwhile get their first token about
    as soon as when the edge is idle."""

    Frames = list[dict[str, Any]]

    async def attack() -> tuple[list[Frames], dict[str, Any], list[float], list[float]]:
        attacker_a = stack.ws_url_as(REPLAY_ATTACKER, edges.a)
        victim = stack.ws_url_as(VICTIM, edges.a)
        await _ttfts(victim, 2)  # its first sockets and requests: not what is timed
        idle = await _ttfts(victim, VICTIMS)
        tokens = []
        for port in (edges.a, edges.b):
            async with websockets.connect(stack.ws_url_as(REPLAY_ATTACKER, port)) as ws:
                accepted = await _open(ws, max_tokens=4)
                await _until_final(ws, [])
            partition = await _partition_of(stack, accepted["request_id"])
            await _others_traffic(stack, partition, FAR_BACK)
            tokens.append(accepted["resume_token"])
        # Writing the 80,000 records took seconds: edge A's bucket has its burst of two back
        # (one request a second; its one request so far was the first stream).
        replays = asyncio.gather(*(_resume(attacker_a, token) for token in tokens))
        resumed, beside = await asyncio.gather(replays, _ttfts(victim, VICTIMS))
        async with websockets.connect(attacker_a) as ws:
            await ws.send(json.dumps({"type": "chat.request", "prompt": "next", "max_tokens": 2}))
            after = await recv_json(ws)
        return resumed, after, idle, beside

    resumed, after, idle, beside = asyncio.run(attack())
    ends = sorted((frames[-1]["type"], frames[-1].get("code")) for frames in resumed)
    assert ends == [("chat.done", None), ("error", "overloaded")], resumed
    (ran,) = [f for f in resumed if f[-1]["type"] == "chat.done"]
    assert len([f for f in ran if f["type"] == "chat.delta"]) == 4  # the whole stream, once
    (refused,) = [f[-1] for f in resumed if f[-1]["type"] == "error"]
    assert "replay" in refused["message"], refused
    assert refused["retry_after_ms"], refused
    # The two resumes took the burst; the 40,000 records read are four requests more, at one
    # a second: the next request waits seconds, not the one second the resumes alone cost.
    assert after["type"] == "error", after
    assert after["code"] == "rate_limited", after
    assert after["retry_after_ms"] > 1500, after
    # The victim, beside the replay (the replay reads with a consumer of its own, and the
    # shared reader skips the other stream's records unparsed): its p90 within twice the
    # idle one (plus 0.25 s: the scheduler's batch wait, on a machine another test shares).
    assert _p90(beside) <= 2 * _p90(idle) + 0.25, (beside, idle)
