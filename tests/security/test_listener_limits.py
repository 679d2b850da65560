"""Attacks on the edge's listener: a request head trickled for ever (slowloris), a silent
connection, a flood of connections, a big WebSocket frame before authentication, and a
client that stops reading what it is sent. Real sockets against a real edge (the write
timeout: against uvicorn running the edge's protocol, `listener.TimedProtocol`).

On the session's shared stack: the limits are settings of an edge of the module's own there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import uvicorn
import websockets
from starlette.types import ASGIApp, Receive, Scope, Send

from services.edge.listener import protocol_class
from tests.stack import Stack, free_port, wait_until

HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 8


@dataclass(frozen=True)
class Edge:
    """The module's own edge of the session's shared stack, with the listener's limits."""

    stack: Stack
    port: int

    def ready(self) -> bool:
        return self.stack.edge_ready(self.port)


@pytest.fixture(scope="module")
def edge(stack: Stack) -> Iterator[Edge]:
    limits = {
        "TOKENBUS_EDGE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "TOKENBUS_EDGE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    }
    with stack.own_edge("edge-listener-limits", **limits) as port:
        yield Edge(stack, port)


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> float:
    """Seconds until the server closed the connection (EOF or reset); fails past `timeout_s`."""
    started = time.monotonic()
    try:
        while await asyncio.wait_for(reader.read(65536), timeout_s):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server held the connection past {timeout_s} s") from None
    return time.monotonic() - started


# -- slowloris -----------------------------------------------------------------------------------


async def test_a_head_trickled_a_byte_at_a_time_is_cut_off(edge: Edge) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n")

    async def trickle() -> None:
        for _ in range(200):
            await asyncio.sleep(0.25)
            writer.write(b"X")
            await writer.drain()

    drip = asyncio.create_task(trickle())
    try:
        took = await closed_within(reader, HEADER_TIMEOUT_S + 5)
    finally:
        drip.cancel()
        await asyncio.gather(drip, return_exceptions=True)
        await closed(writer)
    assert took < HEADER_TIMEOUT_S + 2


async def test_a_silent_connection_is_closed(edge: Edge) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    try:
        took = await closed_within(reader, HEADER_TIMEOUT_S + 5)
    finally:
        await closed(writer)
    assert took < HEADER_TIMEOUT_S + 2


async def test_a_kept_alive_connection_trickling_its_next_head_is_cut_off(edge: Edge) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n")
        first = await asyncio.wait_for(reader.readuntil(b"}"), 5)  # the whole small answer
        assert first.startswith(b"HTTP/1.1 200")
        writer.write(b"GET /healthz HTTP/1.1\r\n")  # the next head, never finished
        for _ in range(3):
            await asyncio.sleep(0.5)
            writer.write(b"X-Slow: 1\r\n")  # bytes keep coming: no keep-alive timeout applies
        took = await closed_within(reader, HEADER_TIMEOUT_S + 5)
    finally:
        await closed(writer)
    assert took < HEADER_TIMEOUT_S + 2


async def test_connections_past_the_limit_are_answered_503(edge: Edge) -> None:
    held = [await asyncio.open_connection("127.0.0.1", edge.port) for _ in range(MAX_CONNECTIONS)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(4096), 5)
        await closed(writer)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
    finally:
        for _, w in held:
            await closed(w)
    # Once the flood is gone, the edge answers again.
    wait_until(edge.ready, 10, "the edge answering again")


# -- WebSocket frames before the key -------------------------------------------------------------


async def test_a_big_frame_before_the_key_closes_the_socket(edge: Edge) -> None:
    async with websockets.connect(edge.stack.ws_url_as(None, edge.port), max_size=None) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": "x" * 65536}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1009


async def test_after_the_key_a_large_frame_is_answered_as_before(edge: Edge) -> None:
    """The small limit holds only until the `auth` frame is accepted."""
    async with websockets.connect(edge.stack.ws_url_as(None, edge.port), max_size=None) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": edge.stack.keys["default"]}))
        big = "x" * 60_000  # 60 kB: above the pre-auth limit, under the frame limit
        await ws.send(
            json.dumps(
                {
                    "type": "chat.request",
                    "client_id": "c1",
                    "messages": [{"role": "user", "content": big}],
                    "max_tokens": 4,
                }
            )
        )
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if frame["type"] in ("chat.done", "error"):
                break
    assert frame["type"] == "chat.done", frame


# -- a client that stops reading -----------------------------------------------------------------

WRITE_TIMEOUT_S = 1.0


class EndlessStream:
    """An ASGI app that streams for ever, as an SSE answer does while tokens come; it
    records whether it was told the client is gone."""

    def __init__(self) -> None:
        self.disconnected = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        watch = asyncio.create_task(self._watch(receive))
        chunk = b"data: " + b"x" * 16384 + b"\n\n"
        try:
            while not self.disconnected.is_set():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            watch.cancel()

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected.set()


@pytest.fixture
async def endless() -> AsyncIterator[tuple[EndlessStream, int]]:
    app = EndlessStream()
    async with serving(app, protocol_class(HEADER_TIMEOUT_S, WRITE_TIMEOUT_S)) as port:
        yield app, port


async def test_a_client_that_stops_reading_is_dropped_within_the_write_timeout(
    endless: tuple[EndlessStream, int],
) -> None:
    app, port = endless
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    try:
        sock.send(b"GET /stream HTTP/1.1\r\nHost: edge\r\n\r\n")
        started = time.monotonic()
        # The client reads nothing; the server fills its buffers, waits, and lets it go.
        await asyncio.wait_for(app.disconnected.wait(), WRITE_TIMEOUT_S + 20)
        took = time.monotonic() - started
    finally:
        sock.close()
    assert took < WRITE_TIMEOUT_S + 10


# -- one address holding every place ----------------------------------------------------------

PER_IP = 4


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers HTTP with 200 and accepts a WebSocket, as the edge's health and chat do."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    elif scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (await receive())["type"] != "websocket.disconnect":
            pass


@pytest.fixture
async def per_ip() -> AsyncIterator[int]:
    bounded = protocol_class(HEADER_TIMEOUT_S, WRITE_TIMEOUT_S, max_per_ip=PER_IP)
    async with serving(hello, bounded) as port:
        yield port


async def kept_alive(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A connection that asks once and then idles, kept alive; None if it was dropped."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n")
    try:
        head = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
    except (asyncio.IncompleteReadError, ConnectionResetError):
        await closed(writer)
        return None
    assert b" 200 " in head.split(b"\r\n")[0], head
    return reader, writer


async def test_one_address_cannot_hold_every_place(per_ip: int) -> None:
    """Issue 37, N10: 4,096 idle keep-alive connections from one address (GET /healthz, no
    key) held every place of the listener. Bounded per address: its idle keep-alive and its
    WebSocket connections count; one more is dropped as it opens; a place freed is free."""
    port = per_ip
    held = [c for c in [await kept_alive(port) for _ in range(PER_IP - 1)] if c is not None]
    try:
        assert len(held) == PER_IP - 1
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/chat") as ws:
            assert await kept_alive(port) is None  # the WebSocket took the last place
            await ws.send("still here")  # and it serves on

        async def freed() -> bool:
            again = await kept_alive(port)
            if again is not None:
                held.append(again)
            return again is not None

        deadline = time.monotonic() + 10
        while not await freed():  # the WebSocket's place, once its close is through
            assert time.monotonic() < deadline, "the WebSocket's place was never freed"
            await asyncio.sleep(0.1)
        assert len(held) == PER_IP
        assert await kept_alive(port) is None
    finally:
        for _, writer in held:
            await closed(writer)


async def closed(writer: asyncio.StreamWriter) -> None:
    """Close a connection and wait until its socket is: a transport closed but not waited for
    may outlive the test's event loop, and its socket warns when collected in a later test."""
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, http: type[asyncio.Protocol]) -> AsyncIterator[int]:
    """uvicorn serving `app` with the edge's protocol class `http`, on a free port."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=http, lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    running = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await running
