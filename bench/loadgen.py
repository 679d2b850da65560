"""Open-loop load: planned arrivals sent on time over a pool of real WebSocket connections."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import websockets
from websockets.asyncio.client import ClientConnection

from bench.stats import percentile
from bench.workload import PlannedRequest

# A frame larger than this is a protocol problem worth failing on, not a sample.
MAX_FRAME_BYTES = 4 * 1024 * 1024
PROGRESS_EVERY_S = 0.5
# Not a protocol code: the client's own record that the server closed the socket.
CONNECTION_CLOSED = "connection_closed"


@dataclass(frozen=True)
class LoadConfig:
    url: str
    connections: int = 8
    concurrency_cap: int = 256
    drain_s: float = 10.0
    # Sent as `Authorization: Bearer`; None: the URL carries the key (ws://tenant:KEY@host/...).
    api_key: str | None = None
    label: str = ""


@dataclass
class RequestTrace:
    """What one client saw of one request; times are `time.monotonic()` seconds."""

    planned: PlannedRequest
    sent_at: float | None = None
    sent_wall: float | None = None  # `time.time()` at send: compared with services' stamps
    lag_s: float = 0.0
    request_id: str | None = None
    accepted_at: float | None = None
    delta_at: list[float] = field(default_factory=list)
    done_at: float | None = None
    error_code: str | None = None
    completion_tokens: int | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    shed: bool = False
    connection: int | None = None  # index of the socket it was sent on

    @property
    def finished(self) -> bool:
        return self.done_at is not None or self.error_code is not None

    @property
    def completed(self) -> bool:
        return self.done_at is not None and self.error_code is None


@dataclass
class LoadResult:
    traces: list[RequestTrace]
    started_at: float  # monotonic time of the schedule's zero
    started_wall: float  # the same instant on the wall clock
    ended_at: float  # monotonic time of the last answer (or the end of the drain)


class _Run:
    """The state one run shares between its sender, its readers and its progress line."""

    def __init__(self, config: LoadConfig, planned: list[PlannedRequest]) -> None:
        self.config = config
        self.traces = [RequestTrace(p) for p in planned]
        self.by_client = {t.planned.client_id: t for t in self.traces}
        self.by_request: dict[str, RequestTrace] = {}
        self.in_flight = 0
        self.sent = 0
        self.shed = 0
        self.finished = 0
        self.errors = 0
        self.all_answered = asyncio.Event()
        self.last_answer = 0.0

    def on_frame(self, raw: str | bytes, now: float) -> None:
        frame = json.loads(raw)
        kind = frame.get("type")
        trace: RequestTrace | None
        if kind == "chat.accepted":
            trace = self.by_client.get(frame.get("client_id", ""))
            if trace is None:
                raise ProtocolViolation(f"chat.accepted for no request of this run: {frame}")
            trace.request_id = frame["request_id"]
            trace.accepted_at = now
            self.by_request[trace.request_id] = trace
            return
        trace = self.by_request.get(frame.get("request_id") or "")
        if trace is None:
            trace = self.by_client.get(frame.get("client_id") or "")
        if trace is None:
            raise ProtocolViolation(f"{kind} frame for no request of this run: {frame}")
        if trace.finished:
            return  # e.g. the `cancelled` error after a drain-time cancel
        if kind == "chat.delta":
            trace.delta_at.append(now)
        elif kind == "chat.reset":
            trace.delta_at.clear()  # a new attempt: its tokens are what the client keeps
        elif kind == "chat.done":
            trace.done_at = now
            trace.completion_tokens = int(frame["usage"]["completion_tokens"])
            trace.timings = dict(frame.get("timings") or {})
            self._answered(now)
        elif kind == "error":
            trace.error_code = str(frame.get("code", "unknown"))
            trace.done_at = None
            self.errors += 1
            self._answered(now)

    def lost(self, trace: RequestTrace, now: float) -> None:
        """The request's socket closed before its answer: an error of the run, not a hang."""
        trace.error_code = CONNECTION_CLOSED
        self.errors += 1
        self._answered(now)

    def _answered(self, now: float) -> None:
        self.in_flight -= 1
        self.finished += 1
        self.last_answer = now
        if self.in_flight == 0 and self.sent + self.shed == len(self.traces):
            self.all_answered.set()


class ProtocolViolation(Exception):
    """The server sent something the protocol does not allow; the run's numbers are void."""


async def run_load(
    config: LoadConfig,
    planned: list[PlannedRequest],
    progress: Callable[[str], None] | None = None,
) -> LoadResult:
    """Send every planned request at its time; return once all are answered or the drain ends."""
    state = _Run(config, planned)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connections: list[ClientConnection] = []
    try:
        for _ in range(max(1, config.connections)):
            connections.append(
                await websockets.connect(
                    config.url,
                    additional_headers=headers,
                    max_size=MAX_FRAME_BYTES,
                    open_timeout=10,
                    ping_interval=None,
                    compression=None,
                )
            )
        async with asyncio.TaskGroup() as tg:
            readers = [tg.create_task(_read(ws, i, state)) for i, ws in enumerate(connections)]
            ticker = tg.create_task(_progress(state, progress)) if progress else None
            started_at, started_wall = time.monotonic(), time.time()
            await _send_all(state, connections, started_at)
            drain_end = time.monotonic() + config.drain_s
            if state.sent + state.shed == len(state.traces) and state.in_flight == 0:
                state.all_answered.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    state.all_answered.wait(), max(0.0, drain_end - time.monotonic())
                )
            ended_at = state.last_answer if state.all_answered.is_set() else time.monotonic()
            await _cancel_unanswered(state, connections)
            if ticker is not None:
                ticker.cancel()
                if progress is not None:
                    progress(_status(state, started_at, final=True))
            for reader in readers:
                reader.cancel()
    finally:
        for ws in connections:
            await ws.close()
    return LoadResult(state.traces, started_at, started_wall, max(ended_at, started_at))


async def _send_all(state: _Run, connections: list[ClientConnection], zero: float) -> None:
    pool = itertools.cycle(range(len(connections)))
    for trace in state.traces:
        due = zero + trace.planned.at_s
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        now = time.monotonic()
        trace.lag_s = max(0.0, now - due)
        if state.in_flight >= state.config.concurrency_cap:
            # Open loop: an arrival the cap refuses is counted, never delayed.
            trace.shed = True
            state.shed += 1
            continue
        trace.sent_at = now
        trace.sent_wall = time.time() - (time.monotonic() - now)
        trace.connection = next(pool)
        state.in_flight += 1
        state.sent += 1
        try:
            await connections[trace.connection].send(json.dumps(trace.planned.body))
        except websockets.ConnectionClosed:
            state.lost(trace, time.monotonic())


async def _read(ws: ClientConnection, index: int, state: _Run) -> None:
    with contextlib.suppress(websockets.ConnectionClosed):  # an abnormal close ends it too
        async for raw in ws:
            state.on_frame(raw, time.monotonic())
    # The server closed the socket: what it still owed on it will never come.
    for trace in state.traces:
        if trace.connection == index and trace.sent_at is not None and not trace.finished:
            state.lost(trace, time.monotonic())


async def _cancel_unanswered(state: _Run, connections: list[ClientConnection]) -> None:
    """Cancel what is still running so the next run starts on an idle stack."""
    for trace in state.traces:
        if trace.finished or trace.request_id is None or trace.connection is None:
            continue
        # Only the socket that sent a request may cancel it.
        with contextlib.suppress(websockets.ConnectionClosed):
            await connections[trace.connection].send(
                json.dumps({"type": "chat.cancel", "request_id": trace.request_id})
            )


async def _progress(state: _Run, show: Callable[[str], None] | None) -> None:
    zero = time.monotonic()
    while show is not None:
        await asyncio.sleep(PROGRESS_EVERY_S)
        show(_status(state, zero))


def _status(state: _Run, zero: float, final: bool = False) -> str:
    label = f"[{state.config.label}] " if state.config.label else ""
    ttfts = sorted(
        (t.delta_at[0] - t.sent_at) * 1000
        for t in state.traces
        if t.sent_at is not None and t.delta_at
    )
    p50 = f"{percentile(ttfts, 50):.0f}ms" if ttfts else "-"
    return (
        f"{label}t={time.monotonic() - zero:5.1f}s sent={state.sent}/{len(state.traces)} "
        f"done={state.finished - state.errors} err={state.errors} in_flight={state.in_flight} "
        f"shed={state.shed} ttft_p50={p50}" + (" ✓" if final else "")
    )


class ProgressLine:
    """One status line, rewritten in place on a terminal, printed every few seconds if not."""

    def __init__(self, stream: TextIO = sys.stderr, every_s: float = 3.0) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.every_s = every_s
        self._last = 0.0

    def __call__(self, text: str) -> None:
        final = text.endswith("✓")
        if self.tty:
            self.stream.write("\r\x1b[2K" + text + ("\n" if final else ""))
            self.stream.flush()
            return
        now = time.monotonic()
        if final or now - self._last >= self.every_s:
            self._last = now
            self.stream.write(text + "\n")
            self.stream.flush()


async def warm_up(url: str, requests: int = 3, timeout_s: float = 60.0) -> None:
    """Send small requests one by one until `requests` complete: the whole path is live.

    A healthy edge does not prove the scheduler and worker have joined their groups;
    measuring before they have would count start-up as latency.
    """
    deadline = time.monotonic() + timeout_s
    done = 0
    async with websockets.connect(url, open_timeout=10, ping_interval=None) as ws:
        while done < requests:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: {done}/{requests} warm-up requests in {timeout_s} s")
            body = {
                "type": "chat.request",
                "client_id": f"warm-{done}",
                "prompt": "warm up",
                "max_tokens": 4,
                "priority": "interactive",
            }
            await ws.send(json.dumps(body))
            while True:
                left = max(0.1, deadline - time.monotonic())
                try:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), left))
                except TimeoutError:
                    raise TimeoutError(
                        f"{url}: {done}/{requests} warm-up requests answered in {timeout_s:g} s"
                    ) from None
                if frame.get("type") == "chat.done":
                    done += 1
                    break
                if frame.get("type") == "error":
                    break
