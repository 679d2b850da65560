"""WebSocket frames on a real socket, before and after the key (issue 37, N10 and N4).

Before its key a socket is read one small message at a time, so a large frame is refused by
its header, unread, and a key sent in an `auth` frame applies to the very next frame, even
one sent in the same write. After it, the messages being received count against the edge's
budget (a tenant's sockets an eighth of it) and must be whole in time: an unfinished
fragmented message no longer holds 4 MiB for as long as its socket stays open.

The session's shared stack (the budget tests: an edge of their own with a small budget and
a short message time); each test speaks WebSocket on a plain socket, so that it can send
what a client library would not (a frame's header without its payload, two frames in one
write, a message never finished).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.frames import Frame, Opcode

from services.edge.settings import EdgeSettings
from services.edge.ws_protocol import frame_header
from tests.stack import Stack

PRE_AUTH_BYTES = EdgeSettings.model_fields["edge_max_unauthenticated_frame_bytes"].default
AUTH_TIMEOUT_S = EdgeSettings.model_fields["edge_auth_timeout_s"].default
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TRY_AGAIN_LATER = 1013
MESSAGE_TIMEOUT_S = 3.0
BUDGET = 32 << 20  # a tenant's sockets: an eighth, 4 MiB
FRAGMENT = 1 << 20  # each attacker socket's first fragment announces this much


class RawSocket:
    """A WebSocket client on a plain TCP connection: frames are sent as given."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, headers: str = "") -> RawSocket:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                f"GET /v1/chat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                f"Sec-WebSocket-Version: 13\r\n{headers}\r\n"
            ).encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert b" 101 " in head.split(b"\r\n")[0], head
        return cls(reader, writer)

    async def send(self, *frames: bytes) -> None:
        self.writer.write(b"".join(frames))  # one write: the edge may read them at once
        await self.writer.drain()

    async def close_of(self, timeout_s: float) -> tuple[int, str, float]:
        """The server's next frame, which must be a close: (code, reason, when it came)."""
        opcode, payload = await self.next_frame(timeout_s)
        assert opcode == Opcode.CLOSE, (opcode, payload[:200])
        return int.from_bytes(payload[:2], "big"), payload[2:].decode(), time.monotonic()

    async def next_frame(self, timeout_s: float) -> tuple[int, bytes]:
        """The server's next frame: (opcode, payload)."""
        head = await asyncio.wait_for(self.reader.readexactly(2), timeout_s)
        extra = {126: 2, 127: 8}.get(head[1] & 0x7F, 0)
        head += await asyncio.wait_for(self.reader.readexactly(extra), timeout_s)
        parsed = frame_header(head)
        assert parsed is not None
        _, length, opcode, _ = parsed
        return opcode, await asyncio.wait_for(self.reader.readexactly(length), timeout_s)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


def text(body: dict[str, Any]) -> bytes:
    return Frame(Opcode.TEXT, json.dumps(body).encode()).serialize(mask=True, extensions=[])


def keyed(stack: Stack, tenant: str) -> str:
    """The upgrade header that carries `tenant`'s key (Basic auth, as `ws_url_as` does)."""
    creds = base64.b64encode(f"{tenant}:{stack.keys[tenant]}".encode()).decode()
    return f"Authorization: Basic {creds}\r\n"


def unfinished(size: int) -> bytes:
    """The start of a fragmented text message: its first frame's header and a few bytes of
    the `size` it announces, never more."""
    return Frame(Opcode.TEXT, b"x" * size, fin=False).serialize(mask=True, extensions=[])[:64]


def request(client_id: str, words: int) -> dict[str, Any]:
    return {
        "type": "chat.request",
        "client_id": client_id,
        "prompt": "hi " * words,
        "max_tokens": 2,
    }


async def answer_of(ws: RawSocket, client_id: str) -> dict[str, Any]:
    """The first frame that answers `client_id`; fails on a close."""
    deadline = time.monotonic() + 30
    while True:
        opcode, payload = await ws.next_frame(max(0.1, deadline - time.monotonic()))
        assert opcode != Opcode.CLOSE, (
            f"closed: {int.from_bytes(payload[:2], 'big')} {payload[2:]!r}"
        )
        frame: dict[str, Any] = json.loads(payload)
        if frame.get("client_id") == client_id:
            return frame


def test_a_large_frame_before_the_key_is_refused_by_its_header_unread(stack: Stack) -> None:
    """Before: the edge read the 4 MiB frame whole (here: waited for it), and the socket
    ended only at the auth timeout (1008)."""

    async def attack() -> tuple[int, float]:
        ws = await RawSocket.open(stack.edge_port)
        try:
            big = Frame(Opcode.TEXT, b"x" * (4 << 20)).serialize(mask=True, extensions=[])
            began = time.monotonic()
            await ws.send(big[:1024])  # its header and a little: the rest never comes
            opcode, payload = await ws.next_frame(AUTH_TIMEOUT_S * 2)
            assert opcode == Opcode.CLOSE
            return int.from_bytes(payload[:2], "big"), time.monotonic() - began
        finally:
            await ws.close()

    code, took = asyncio.run(attack())
    assert code == CLOSE_MESSAGE_TOO_BIG
    assert took < AUTH_TIMEOUT_S / 2, took


def test_an_auth_frame_and_a_large_request_in_one_write_are_both_served(stack: Stack) -> None:
    """The chat page sends its `auth` and then its requests at once: the request, above the
    pre-auth bound, is read under the key's bound."""

    async def chat() -> dict[str, Any]:
        ws = await RawSocket.open(stack.edge_port)
        try:
            await ws.send(
                text({"type": "auth", "api_key": stack.keys["default"]}),
                text(request("after-auth", PRE_AUTH_BYTES)),  # 3x the pre-auth bound
            )
            return await answer_of(ws, "after-auth")
        finally:
            await ws.close()

    assert asyncio.run(chat())["type"] == "chat.accepted"


def test_a_socket_keyed_in_its_upgrade_may_send_a_large_first_frame(stack: Stack) -> None:
    async def chat() -> dict[str, Any]:
        ws = await RawSocket.open(stack.edge_port, keyed(stack, "default"))
        try:
            await ws.send(text(request("keyed", PRE_AUTH_BYTES)))
            return await answer_of(ws, "keyed")
        finally:
            await ws.close()

    assert asyncio.run(chat())["type"] == "chat.accepted"


@pytest.fixture(scope="module")
def small_edge(stack: Stack) -> Iterator[int]:
    """An edge of the module's own: a small message budget and a short message time."""
    settings = {
        "TOKENBUS_EDGE_BODY_TIMEOUT_S": str(MESSAGE_TIMEOUT_S),
        "TOKENBUS_EDGE_BODY_BUDGET_BYTES": str(BUDGET),
    }
    with stack.own_edge("edge-ws-budget", **settings) as port:
        yield port


def test_unfinished_messages_stop_at_the_tenants_share_and_others_chat_on(
    stack: Stack, small_edge: int
) -> None:
    """Before: each socket held its unfinished 4 MiB message for as long as it stayed open,
    however many the tenant opened."""

    async def attack() -> tuple[list[tuple[int, str]], dict[str, Any]]:
        holders = [await RawSocket.open(small_edge, keyed(stack, "alice")) for _ in range(5)]
        try:
            # Five 1 MiB messages begun; the tenant's share is four. Which socket the edge
            # reads last is its own affair: that one is refused, whichever it is.
            for ws in holders:
                await ws.send(unfinished(FRAGMENT))
            # Another tenant chats on, on the same edge, meanwhile.
            victim = await RawSocket.open(small_edge, keyed(stack, "bob"))
            try:
                await victim.send(text(request("victim", 8)))
                answer = await answer_of(victim, "victim")
            finally:
                await victim.close()
            # The four never finish their messages: each is let go when its time is up.
            began = time.monotonic()
            closes = await asyncio.gather(*(ws.close_of(MESSAGE_TIMEOUT_S * 4) for ws in holders))
            return [
                (code, f"{reason} after {took - began:.1f} s") for code, reason, took in closes
            ], answer
        finally:
            for ws in holders:
                await ws.close()

    closes, answer = asyncio.run(attack())
    assert sorted(code for code, _ in closes) == [CLOSE_POLICY_VIOLATION] * 4 + [
        CLOSE_TRY_AGAIN_LATER
    ], closes
    assert answer["type"] == "chat.accepted"


def test_a_socket_whose_messages_come_whole_is_not_let_go(stack: Stack, small_edge: int) -> None:
    """The budget and the time bound an unfinished message, not a socket that chats: two
    messages far apart, each whole, are both answered."""

    async def chat() -> list[str]:
        ws = await RawSocket.open(small_edge, keyed(stack, "default"))
        try:
            await ws.send(text(request("first", 8)))
            first = await answer_of(ws, "first")
            # Idle past the message time: the scenario itself, not a wait for something.
            await asyncio.sleep(MESSAGE_TIMEOUT_S * 1.5)
            await ws.send(text(request("second", 8)))
            return [first["type"], (await answer_of(ws, "second"))["type"]]
        finally:
            await ws.close()

    assert asyncio.run(chat()) == ["chat.accepted", "chat.accepted"]
