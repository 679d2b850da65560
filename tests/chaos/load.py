"""Open-loop chaos load: WebSocket users that resume on the other edge, and Kafka producers.

Every requester keeps what it saw of each request (`tests/chaos/checker.py` judges it) and
when (monotonic clock: sent, accepted, first token, final; `tests/chaos/availability.py`
turns them into availability and TTFT figures). A WebSocket user whose socket drops opens
one on the other edge and sends `stream.resume` for each accepted request without a final,
naming the attempt and `seq` it last showed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import websockets
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from services.worker.engines.sim_text import complete
from shared.kafka import make_producer
from shared.settings import TokenbusSettings
from tests.chaos.availability import Sample
from tests.chaos.checker import Channel, History

if TYPE_CHECKING:
    from tests.chaos.openai_load import OpenAiRequester

Frame = dict[str, Any]
# A request refused `overloaded` is sent again after this (with `retry_refused`).
REFUSED_RETRY_S = 1.0
# A refused resume (`overloaded`) is tried again after 0.5 s, doubling to 4 s, as a client
# honouring a retry hint would.
RESUME_RETRY_S = (0.5, 4.0)


@dataclass(frozen=True)
class Planned:
    """One request of the load: when it leaves, over what, and what it asks."""

    at_s: float
    channel: str  # a checker channel: "websocket", "kafka", "openai-stream", "openai"
    prompt: str
    max_tokens: int
    priority: str

    @property
    def expected_text(self) -> str:
        return self.expected_text_of(self.prompt)

    def expected_text_of(self, engine_prompt: str) -> str:
        """The sim's answer when its engine is given `engine_prompt` (a chat request's
        messages reach it as `role: content` lines)."""
        return complete(engine_prompt, self.max_tokens).text


def plan_load(
    seed: int, rate: dict[str, float], duration_s: float, tokens: tuple[int, int] = (8, 40)
) -> list[Planned]:
    """Poisson arrivals per channel at `rate` req/s for `duration_s`, merged by time; each
    asks for a `max_tokens` drawn from `tokens` (inclusive)."""
    rng = random.Random(seed)
    planned: list[Planned] = []
    for channel, per_s in sorted(rate.items()):
        at, i = rng.expovariate(per_s), 0
        while at < duration_s:
            planned.append(
                Planned(
                    at_s=at,
                    channel=channel,
                    prompt=f"chaos {seed} {channel} {i}",
                    max_tokens=rng.randint(*tokens),
                    priority=rng.choice(("interactive", "interactive", "background")),
                )
            )
            at += rng.expovariate(per_s)
            i += 1
    return sorted(planned, key=lambda p: p.at_s)


# -- WebSocket -----------------------------------------------------------------------------


@dataclass
class WsRequest:
    planned: Planned
    client_id: str
    sent: bool = False
    request_id: str | None = None
    resume_token: str | None = None
    frames: list[Frame] = field(default_factory=list)
    attempt: int = 0
    last_seq: int = -1
    final: bool = False
    resuming: bool = False
    resume_refusals: int = 0  # in a row; reset when a resume is answered
    refused: str | None = None  # an error before `chat.accepted`: never acknowledged
    resent: int = 0  # times its socket dropped before `chat.accepted` and it was sent again
    # time.monotonic() when `chat.request` was sent, `chat.accepted` came, the first
    # `chat.delta` ever shown came (a `chat.reset` does not restart it), the final came.
    sent_at: float | None = None
    accepted_at: float | None = None
    first_token_at: float | None = None
    final_at: float | None = None
    resets_at: list[float] = field(default_factory=list)  # each `chat.reset` shown

    @property
    def settled(self) -> bool:
        """Nothing more is owed to the client about it."""
        return self.final or self.refused is not None or not self.sent


class WsUser:
    """One chat user: one socket at a time, moved to the other edge when it drops."""

    def __init__(
        self,
        name: str,
        urls: list[str],
        first: int,
        log: Callable[[str], None],
        *,
        retry_refused: bool = False,
    ) -> None:
        self.name = name
        self.urls = urls  # read at each connect: who holds the list may swap an edge in it
        # Send a request refused `overloaded` before acceptance again after a pause, as a
        # client that honours the retry hint (a draining edge refuses: tests/upgrade/).
        self.retry_refused = retry_refused
        self.refusals_retried = 0
        self.edge = first
        self.log = log
        self.requests: dict[str, WsRequest] = {}
        self._by_request: dict[str, WsRequest] = {}
        self._outbox: asyncio.Queue[WsRequest] = asyncio.Queue()
        self.reconnects = 0
        self.resume_retries = 0
        self.protocol_errors: list[str] = []
        self._retries: set[asyncio.Task[None]] = set()

    def submit(self, planned: Planned) -> None:
        request = WsRequest(planned, client_id=f"{self.name}-{len(self.requests)}")
        self.requests[request.client_id] = request
        self._outbox.put_nowait(request)

    def settled(self) -> bool:
        return self._outbox.empty() and all(r.settled for r in self.requests.values())

    def histories(self) -> list[History]:
        return [
            History(r.request_id, "websocket", r.planned.expected_text, tuple(r.frames))
            for r in self.requests.values()
            if r.request_id is not None
        ]

    async def run(self) -> None:
        """Keep a socket open to some edge until cancelled."""
        while True:
            url = self.urls[self.edge]
            try:
                async with websockets.connect(
                    url,
                    open_timeout=5,
                    ping_interval=None,
                    max_size=4 * 1024 * 1024,
                ) as ws:
                    await self._serve(ws)
            except (OSError, TimeoutError, websockets.InvalidHandshake):
                await asyncio.sleep(0.2)  # that edge is down: try the other one
            except websockets.ConnectionClosed:
                pass
            self._send_unaccepted_again()
            self.edge = (self.edge + 1) % len(self.urls)
            self.reconnects += 1

    def _send_unaccepted_again(self) -> None:
        """As the chat page does: a request its socket dropped before `chat.accepted` is
        sent again on the next socket (a new request to the edge; one answer shown)."""
        for r in self.requests.values():
            if r.sent and r.request_id is None and r.refused is None and not r.final:
                r.sent, r.resent = False, r.resent + 1
                self._outbox.put_nowait(r)
            r.resuming = False

    async def _serve(self, ws: websockets.ClientConnection) -> None:
        if self.reconnects:
            self.log(f"{self.name} connected to {_without_key(self.urls[self.edge])}")
        for r in self._by_request.values():
            if not r.final:
                await self._resume(ws, r)
        writer = asyncio.create_task(self._write(ws))
        try:
            async for raw in ws:
                self._on_frame(ws, json.loads(raw))
        finally:
            await cancel_all([writer, *self._retries])

    async def _resume(self, ws: websockets.ClientConnection, r: WsRequest) -> None:
        r.resuming = True
        await ws.send(
            json.dumps(
                {
                    "type": "stream.resume",
                    "resume_token": r.resume_token,
                    "after_seq": r.last_seq,
                    "attempt": r.attempt,
                }
            )
        )

    async def _write(self, ws: websockets.ClientConnection) -> None:
        while True:
            r = await self._outbox.get()
            p = r.planned
            body = {
                "type": "chat.request",
                "client_id": r.client_id,
                "prompt": p.prompt,
                "max_tokens": p.max_tokens,
                "priority": p.priority,
            }
            r.sent = True
            if r.sent_at is None:  # a request sent again keeps its first time: TTFT from it
                r.sent_at = time.monotonic()
            await ws.send(json.dumps(body))

    def _on_frame(self, ws: websockets.ClientConnection, frame: Frame) -> None:
        kind = frame.get("type")
        if kind == "chat.accepted":
            sent = self.requests[frame["client_id"]]
            sent.request_id, sent.resume_token = frame["request_id"], frame["resume_token"]
            sent.accepted_at = time.monotonic()
            self._by_request[frame["request_id"]] = sent
            sent.frames.append(frame)
            return
        rid = frame.get("request_id")
        if rid is None:
            client = self.requests.get(frame.get("client_id") or "")
            if kind == "error" and client is not None and client.request_id is None:
                if self.retry_refused and frame.get("code") == "overloaded":
                    self.refusals_retried += 1
                    task = asyncio.create_task(self._send_later(client))
                    self._retries.add(task)
                    task.add_done_callback(self._retries.discard)
                    return
                client.refused = str(frame.get("code"))
            else:
                self.protocol_errors.append(f"{self.name}: frame for nobody: {frame}")
            return
        r = self._by_request.get(rid)
        if r is None:
            self.protocol_errors.append(f"{self.name}: frame for an unknown request: {frame}")
            return
        if kind == "error" and r.resuming and frame.get("code") == "overloaded":
            # The resume could not read the stream now: not the request's outcome; again.
            self.resume_retries += 1
            r.resume_refusals += 1
            task = asyncio.create_task(self._resume_later(ws, r))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)
            return
        r.frames.append(frame)
        if kind == "stream.resumed":
            r.resuming, r.resume_refusals = False, 0
        elif kind == "chat.delta":
            r.last_seq = int(frame["seq"])
            if r.first_token_at is None:
                r.first_token_at = time.monotonic()
        elif kind == "chat.reset":
            r.attempt, r.last_seq = int(frame["attempt"]), -1
            r.resets_at.append(time.monotonic())
        elif kind in ("chat.done", "error"):
            if not r.final:
                r.final_at = time.monotonic()
            r.final, r.resuming = True, False

    async def _send_later(self, r: WsRequest) -> None:
        """`r` again, on whatever socket is open then (a socket that drops first sends it
        again itself: `_send_unaccepted_again`)."""
        await asyncio.sleep(REFUSED_RETRY_S)
        r.sent = False
        self._outbox.put_nowait(r)

    async def _resume_later(self, ws: websockets.ClientConnection, r: WsRequest) -> None:
        first, cap = RESUME_RETRY_S
        await asyncio.sleep(min(cap, first * 2 ** (r.resume_refusals - 1)))
        await self._resume(ws, r)


# -- Kafka ---------------------------------------------------------------------------------


@dataclass
class KafkaRequest:
    planned: Planned
    request_id: str
    acked: bool | None = None  # None: the produce has not answered yet
    records: list[Frame] = field(default_factory=list)
    read_at: list[float] = field(default_factory=list)  # each record's, monotonic
    # time.monotonic() when the app called send, the broker acknowledged the write, the first
    # `delta` record was read from the reply topic, the first final record was read.
    sent_at: float | None = None
    acked_at: float | None = None
    first_token_at: float | None = None
    final_at: float | None = None

    @property
    def final(self) -> bool:
        return self.final_record is not None

    @property
    def final_record(self) -> Frame | None:
        """The first `done` or `error` record read: the request's outcome."""
        return next((r for r in self.records if r["kind"] in ("done", "error")), None)

    def read(self, record: Frame, at: float) -> None:
        """File one reply record, read at `at` (monotonic), in offset order."""
        if record.get("kind") == "delta" and self.first_token_at is None:
            self.first_token_at = at
        if record.get("kind") in ("done", "error") and self.final_at is None:
            self.final_at = at
        self.records.append(record)
        self.read_at.append(at)

    def splice_gaps(self) -> list[float]:
        """For each later attempt of one whose text was read: from the last record read of
        the attempt it replaced to its first record that adds text beyond that attempt's (or
        its final): how long a reader waited for the answer to go on (a continuation writes
        the text so far first)."""
        gaps: list[float] = []
        attempt, text, shown = 0, 0, None
        lost_at: float | None = None  # the last record read of the attempt under way
        for record, at in zip(self.records, self.read_at, strict=True):
            kind, a = record.get("kind"), int(record.get("attempt", 0))
            if a < attempt or kind == "reset":
                continue
            if a > attempt:  # a re-run: a splice only where the lost attempt sent text
                attempt, shown, text = a, (text if text and lost_at is not None else None), 0
            text += len(str(record.get("text") or "")) if kind == "delta" else 0
            if shown is not None and lost_at is not None and (text > shown or kind != "delta"):
                gaps.append(at - lost_at)
                shown = None
            if shown is None:  # in a splice, the loss stays where the replaced attempt ended
                lost_at = at
        return gaps


class KafkaRequester:
    """An external application: writes requests with its own reply_to, reads that topic."""

    def __init__(
        self, bootstrap: str, requests_topic: str, reply_topic: str, partitions: int, tag: str
    ) -> None:
        self.requests_topic = requests_topic
        self.reply_topic = reply_topic
        self.partitions = partitions
        self.tag = tag
        # An application's producer as the README asks for: idempotent, acks=all.
        self.producer = make_producer(
            TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap), client_id=f"chaos-app-{tag}"
        )
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False
        )
        self.requests: dict[str, KafkaRequest] = {}
        self.produce_errors: list[str] = []
        self.foreign: list[str] = []
        self._sends: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.producer.start()
        await self.consumer.start()
        parts = [TopicPartition(self.reply_topic, p) for p in range(self.partitions)]
        self.consumer.assign(parts)
        await self.consumer.seek_to_beginning(*parts)

    async def stop(self) -> None:
        for task in self._sends:
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)
        for client in (self.producer, self.consumer):
            try:
                await client.stop()
            except (KafkaError, asyncio.CancelledError) as exc:
                # A fetch to a node still restarting fails the close (aiokafka); the run is
                # over and judged already, so that is no reason to lose its report.
                if (me := asyncio.current_task()) is not None and me.cancelling():
                    raise
                print(f"[chaos] requester close: {exc!r}")

    def submit(self, planned: Planned) -> None:
        rid = f"chaos-{self.tag}-{len(self.requests)}"
        request = KafkaRequest(planned, rid)
        self.requests[rid] = request
        task = asyncio.create_task(self._send(request))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _send(self, request: KafkaRequest) -> None:
        p = request.planned
        value = {
            "request_id": request.request_id,
            "tenant": "chaos-app",
            "prompt": p.prompt,
            "max_tokens": p.max_tokens,
            "priority": p.priority,
            "reply_to": {"topic": self.reply_topic},
        }
        request.sent_at = time.monotonic()
        try:
            await self.producer.send_and_wait(
                self.requests_topic, json.dumps(value).encode(), key=request.request_id.encode()
            )
        except KafkaError as exc:
            request.acked = False
            self.produce_errors.append(f"{request.request_id}: {exc!r}")
        else:
            request.acked, request.acked_at = True, time.monotonic()

    async def read(self) -> None:
        """File every reply record under its request, in offset order, until cancelled."""
        while True:
            batches = await self.consumer.getmany(timeout_ms=200)
            at = time.monotonic()
            for records in batches.values():
                for record in records:
                    value: Frame = json.loads(record.value or b"{}")
                    request = self.requests.get(str(value.get("request_id")))
                    if request is None:
                        self.foreign.append(str(value)[:200])
                    else:
                        request.read(value, at)

    def settled(self) -> bool:
        return all(r.acked is False or (r.acked and r.final) for r in self.requests.values())

    def histories(self) -> list[History]:
        return [
            History(r.request_id, "kafka", r.planned.expected_text, tuple(r.records))
            for r in self.requests.values()
            if r.acked
        ]


# -- the run ---------------------------------------------------------------------------------


@dataclass
class LoadRun:
    users: list[WsUser]
    app: KafkaRequester
    planned: list[Planned]
    # The OpenAI API's requesters, by channel (tests/chaos/openai_load.py).
    apis: dict[str, OpenAiRequester] = field(default_factory=dict)
    zero: float | None = None  # time.monotonic() of the load's t=0, once send_all began

    async def send_all(self, zero: float, until: Callable[[], bool] | None = None) -> None:
        """Hand each planned request to its requester at its time (open loop: never waits);
        with `until`, stop once it is true (what was not sent leaves the plan)."""
        self.zero = zero
        ws_i = 0
        for n, p in enumerate(self.planned):
            delay = zero + p.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if until is not None and until():
                del self.planned[n:]
                return
            if p.channel == "kafka":
                self.app.submit(p)
            elif p.channel in self.apis:
                self.apis[p.channel].submit(p)
            else:
                self.users[ws_i % len(self.users)].submit(p)
                ws_i += 1

    def settled(self) -> bool:
        apis = all(api.settled() for api in self.apis.values())
        return apis and self.app.settled() and all(u.settled() for u in self.users)

    def finals(self) -> int:
        """How many requests have their final outcome now: rises while the system answers."""
        ws = sum(r.final for u in self.users for r in u.requests.values())
        apis = sum(r.final for api in self.apis.values() for r in api.requests)
        return ws + apis + sum(r.final for r in self.app.requests.values())

    def histories(self) -> list[History]:
        apis = [h for api in self.apis.values() for h in api.histories()]
        return [h for u in self.users for h in u.histories()] + self.app.histories() + apis

    def counts(self) -> dict[str, int]:
        ws = [r for u in self.users for r in u.requests.values()]
        return {
            "planned": len(self.planned),
            **{
                f"ws_refused_{code}": n
                for code, n in sorted(Counter(r.refused for r in ws if r.refused).items())
            },
            "ws_resent": sum(r.resent for r in ws),
            "ws_unsent": sum(not r.sent for r in ws),
            "kafka_unacked": sum(r.acked is False for r in self.app.requests.values()),
            **{k: n for api in self.apis.values() for k, n in api.counts().items()},
        }

    def samples(self) -> list[Sample]:
        """One per planned request, in time from the load's zero (tests/chaos/availability.py).

        A request never sent (or never handed to a requester) counts as offered at its
        planned time, not accepted.
        """
        if self.zero is None:
            raise RuntimeError("no samples before send_all has begun: the load has no zero")
        zero = self.zero
        samples = [_ws_sample(r, zero) for u in self.users for r in u.requests.values()]
        samples += [_kafka_sample(r, zero) for r in self.app.requests.values()]
        samples += [s for api in self.apis.values() for s in api.samples(zero)]
        handed = {r.planned for u in self.users for r in u.requests.values()}
        handed |= {r.planned for r in self.app.requests.values()}
        handed |= {r.planned for api in self.apis.values() for r in api.requests}
        samples += [
            Sample(cast(Channel, p.channel), p.at_s, None, accepted=False, answered=False)
            for p in self.planned
            if p not in handed
        ]
        return sorted(samples, key=lambda s: s.sent_at_s)

    def marks(self) -> list[tuple[str, float]]:
        """When each `chat.reset` and each SSE `error` event reached its client, from zero."""
        zero = self.zero or 0.0
        resets = [at for u in self.users for r in u.requests.values() for at in r.resets_at]
        errors = [
            at for api in self.apis.values() for r in api.requests for at in r.error_events_at
        ]
        return sorted(
            [("chat.reset", at - zero) for at in resets]
            + [("sse error", at - zero) for at in errors],
            key=lambda mark: mark[1],
        )

    def splice_gaps(self) -> list[float]:
        """Every re-run's splice gap on the Kafka channel (`KafkaRequest.splice_gaps`)."""
        return [g for r in self.app.requests.values() for g in r.splice_gaps()]

    def seen(self) -> dict[str, int]:
        """How often the faults showed: resets, resumes, re-run attempts on the reply topic."""
        frames = [f for u in self.users for r in u.requests.values() for f in r.frames]
        records = [x for r in self.app.requests.values() for x in r.records]
        return {
            "ws_resets": sum(f["type"] == "chat.reset" for f in frames),
            "ws_resumed_streams": sum(f["type"] == "stream.resumed" for f in frames),
            "ws_reconnects": sum(u.reconnects for u in self.users),
            "ws_resume_retries": sum(u.resume_retries for u in self.users),
            "kafka_later_attempt_records": sum(int(x["attempt"]) > 0 for x in records),
            **{k: n for api in self.apis.values() for k, n in api.seen().items()},
        }


def _ws_sample(r: WsRequest, zero: float) -> Sample:
    final = next((f for f in r.frames if f["type"] in ("chat.done", "error")), None)
    code = None if final is None else "done" if final["type"] == "chat.done" else final.get("code")
    timed = (r.planned, r.sent_at, r.first_token_at)
    return _sample("websocket", timed, zero, r.request_id is not None, code, r.refused)


def _kafka_sample(r: KafkaRequest, zero: float) -> Sample:
    final = r.final_record
    code = None if final is None else "done" if final["kind"] == "done" else final.get("code")
    return _sample("kafka", (r.planned, r.sent_at, r.first_token_at), zero, bool(r.acked), code)


def _sample(
    channel: Channel,
    timed: tuple[Planned, float | None, float | None],
    zero: float,
    accepted: bool,
    code: object,
    refused: str | None = None,
) -> Sample:
    """`timed`: the request's plan, when it was sent and when its first token came."""
    planned, sent_at, first_token_at = timed
    return Sample(
        channel,
        sent_at_s=planned.at_s if sent_at is None else sent_at - zero,
        ttft_s=_elapsed(sent_at, first_token_at),
        accepted=accepted,
        answered=accepted and code == "done",
        final_code=refused if code is None else str(code),
    )


def _elapsed(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel and await each task; a task that died of a closed socket counts as ended."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
            await task


def _without_key(url: str) -> str:
    """The URL as logged: the API key in its user part left out (no secret in a log)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=host).geturl()
