"""Attacks on the OpenAI-compatible HTTP API: a body without end, a body that never ends
(slow, or many held at once), JSON nested past the interpreter's stack, more streams than
the tenant's `sockets`. Each is sent as an attacker
would, over a real socket to a real edge. (A client that stops reading its stream:
test_listener_limits.py.)

On the session's shared stack: the edge is one of the module's own, with the body timeout,
budget and grace period it tests; its tenants are in tests/tenants.py (`HTTP_LIMITS`), and
its answers are the sim's echo of the prompt (the shared stack's echo marker)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.stack import Stack, wait_until
from tests.tenants import ECHO_MARKER

MODEL = "sim-8b"
ECHO = ECHO_MARKER
BODY_LIMIT = 1 << 20  # TOKENBUS_EDGE_MAX_FRAME_BYTES's default: the body limit
SEND_BUFFER = 1 << 16  # the attacker's socket's
BODY_TIMEOUT_S = 2.0
BODY_BUDGET = 2 << 20  # bytes of unfinished bodies the edge holds, all clients together
TWO_STREAMS, ONE_STREAM = "http-two-streams", "http-one-stream"  # tests/tenants.py


@dataclass(frozen=True)
class Api:
    """The HTTP API under attack: an edge of the module's own on the session's shared stack,
    with the edge settings the module tests."""

    stack: Stack
    edge_port: int

    @property
    def http_url(self) -> str:
        return self.stack.http_url_at(self.edge_port)

    @property
    def keys(self) -> dict[str, str]:
        return self.stack.keys


@pytest.fixture(scope="module")
def api(stack: Stack) -> Iterator[Api]:
    settings = {
        "TOKENBUS_EDGE_DISCONNECT_GRACE_S": "2",
        "TOKENBUS_EDGE_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "TOKENBUS_EDGE_BODY_BUDGET_BYTES": str(BODY_BUDGET),
    }
    with stack.own_edge("edge-http-limits", **settings) as port:
        edge = Api(stack, port)
        wait_until(lambda: MODEL in models(edge), 30, "the worker's model on /v1/models")
        yield edge


def auth(stack: Api, tenant: str = "default") -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.keys[tenant]}"}


def models(stack: Api) -> list[str]:
    got = httpx.get(f"{stack.http_url}/v1/models", headers=auth(stack))
    return [m["id"] for m in got.json().get("data", [])] if got.status_code == 200 else []


def echo_request(text: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": ECHO + text}],
        "max_tokens": max_tokens,
        "stream": True,
    }


def long_text(tokens: int) -> str:
    """Echoed 4 characters a token: `tokens` tokens of it (sim_text.ECHO_PIECE_CHARS)."""
    return ("abcd" * tokens)[: tokens * 4]


def flood(port: int, head: bytes, framed: bytes, most: int) -> tuple[bytes, int]:
    """Send `head`, then `framed` over and over until the edge answers (or `most` bytes went,
    or a send fails: the edge closed); return the answer, read to its end, and the bytes sent.

    A plain socket, not asyncio's streams: once a send fails, asyncio's transport closes
    the socket and drops an answer it had not read yet (the edge's 413 arrives just before
    its reset, while the sender is still writing); a plain socket still reads it.
    """
    sent = 0
    pending = memoryview(framed)  # what is left of the frame in hand (sends may be partial)
    with socket.socket() as sock:
        # A small send buffer: what counts as sent is what the edge could have read, give
        # or take its own receive buffer.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        sock.settimeout(10)
        sock.connect(("127.0.0.1", port))
        sock.sendall(head)
        while sent < most:
            readable, writable, _ = select.select([sock], [sock], [], 5)
            if readable or not writable:
                break
            try:
                n = sock.send(pending)
            except OSError:  # reset or broken pipe: the edge answered and closed
                break
            sent += n
            pending = pending[n:] or memoryview(framed)
        return whole_answer(sock), sent


def whole_answer(sock: socket.socket) -> bytes:
    """An HTTP answer read until its body is whole: the head and the body may arrive in
    separate reads. Ends early, with what came, on the connection's end (a reset included:
    the answer announced its close)."""
    data = b""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        head, sep, body = data.partition(b"\r\n\r\n")
        lengths = [
            int(line.split(b":", 1)[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        ]
        if sep and lengths and len(body) >= lengths[0]:
            break
        try:
            more = sock.recv(65536)
        except OSError:
            break
        if not more:
            break
        data += more
    return data


# -- a body without end -------------------------------------------------------------------------


def test_a_chunked_body_without_end_gets_413_before_it_is_read(api: Api) -> None:
    """The attacker streams chunks for ever; the edge answers 413 once past its limit and
    closes the connection, having read about the limit, not what was sent."""
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {api.keys['default']}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"[" * 65536
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    # Up to 64 MiB: the old edge read it all (and would read more) before answering.
    data, sent = flood(api.edge_port, head, framed, 64 * BODY_LIMIT)
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), data[:200]
    assert sent <= 8 * BODY_LIMIT, f"the edge read {sent} bytes before answering"
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "request_too_large"
    assert body["error"]["type"] == "invalid_request_error"
    assert b"connection: close" in rest.lower()


def test_a_declared_oversized_body_gets_413_unread(api: Api) -> None:
    got = httpx.post(
        f"{api.http_url}/v1/completions",
        headers=auth(api),
        content=b"{" + b" " * (BODY_LIMIT + 1) + b"}",
    )
    assert got.status_code == 413
    assert got.json()["error"]["code"] == "request_too_large"


# -- JSON nested past the stack ------------------------------------------------------------------


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_json_nested_past_the_stack_gets_a_typed_400(api: Api, opener: str) -> None:
    depth = 100_000  # under the body limit; far past Python's recursion limit
    got = httpx.post(
        f"{api.http_url}/v1/chat/completions",
        headers={**auth(api), "Content-Type": "application/json"},
        content=(opener * depth).encode(),
    )
    assert got.status_code == 400, got.text[:200]
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_request"
    assert "nested" in error["message"]
    assert "Traceback" not in got.text


# -- streams against the tenant's `sockets` ------------------------------------------------------


async def open_stream(
    client: httpx.AsyncClient, stack: Api, tenant: str, tokens: int
) -> httpx.Response:
    request = client.build_request(
        "POST",
        f"{stack.http_url}/v1/chat/completions",
        headers=auth(stack, tenant),
        json=echo_request(long_text(tokens), tokens),
    )
    return await client.send(request, stream=True)


async def test_the_streams_past_the_tenants_sockets_are_refused(api: Api) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        held = [await open_stream(client, api, TWO_STREAMS, 4000) for _ in range(2)]
        try:
            assert [r.status_code for r in held] == [200, 200]
            third = await open_stream(client, api, TWO_STREAMS, 8)
            await third.aread()
            assert third.status_code == 429, third.text[:200]
            error = third.json()["error"]
            assert error["code"] == "rate_limit_exceeded"
            assert "sockets" in error["message"]
            assert third.headers.get("retry-after")
            # Another tenant is not held back by this one's streams.
            other = await open_stream(client, api, "default", 8)
            await other.aread()
            assert other.status_code == 200
        finally:
            for r in held:
                await r.aclose()

        # The ended streams gave their places back.
        async def admitted() -> bool:
            r = await open_stream(client, api, TWO_STREAMS, 4)
            await r.aread()
            return r.status_code == 200

        deadline = time.monotonic() + 10
        while not await admitted():
            assert time.monotonic() < deadline, "the closed streams' places were not given back"
            await asyncio.sleep(0.1)


# -- bodies that never finish (issue 37, N4) ----------------------------------------------------


async def unfinished(stack: Api, tenant: str, declared: int, sent: int) -> asyncio.StreamReader:
    """A request whose head declares `declared` body bytes, of which `sent` are sent; the
    connection is then held, writing nothing more. Its reader gets the edge's answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.edge_port)
    writer.write(
        (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
            f"Authorization: Bearer {stack.keys[tenant]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n"
        ).encode()
        + b" " * sent
    )
    await writer.drain()
    HELD.append(writer)
    return reader


HELD: list[asyncio.StreamWriter] = []


async def status_of(reader: asyncio.StreamReader, within_s: float) -> int:
    line = await asyncio.wait_for(reader.readline(), within_s)
    assert line.startswith(b"HTTP/1.1 "), line
    return int(line.split()[1])


async def test_a_body_that_never_finishes_gets_408_within_the_body_timeout(api: Api) -> None:
    """Before: uvicorn has no body timeout and the edge read on for ever, the connection and
    its buffered bytes held as long as the client liked."""
    started = time.monotonic()
    try:
        reader = await unfinished(api, "default", 1000, 10)
        assert await status_of(reader, BODY_TIMEOUT_S + 10) == 408
        assert time.monotonic() - started < BODY_TIMEOUT_S + 5
    finally:
        for writer in HELD:
            await closed(writer)
        HELD.clear()


async def test_held_bodies_stop_at_the_edges_budget_and_the_tenants_places(api: Api) -> None:
    """Before: 1,500 connections each holding an unfinished 1 MiB body exceeded the edge's
    memory. Now the bytes held are bounded for the edge (a body past its budget: 503 with a
    retry hint) and per tenant (an unfinished body holds one of its `sockets`: 429), and
    another tenant's request is still served."""
    part = 700 << 10
    try:
        # Three: 2.1 MB, past the 2 MiB. Which one the budget refuses depends on the order
        # the edge reads their bytes in: one of them, at once.
        bodies = [await unfinished(api, "default", BODY_LIMIT, part) for _ in range(3)]
        answers = [asyncio.ensure_future(status_of(r, BODY_TIMEOUT_S + 10)) for r in bodies]
        first, _ = await asyncio.wait(answers, return_when=asyncio.FIRST_COMPLETED)
        assert [a.result() for a in first] == [503]
        held = [a for a in answers if a not in first]
        # A tenant of one socket place: its unfinished body holds it.
        await unfinished(api, ONE_STREAM, BODY_LIMIT, 1000)
        async with httpx.AsyncClient(timeout=30) as client:

            async def second() -> httpx.Response:
                return await client.post(
                    f"{api.http_url}/v1/chat/completions",
                    headers=auth(api, ONE_STREAM),
                    json={**echo_request("x", 4), "stream": False},
                )

            deadline = time.monotonic() + 10
            while (r := await second()).status_code != 429:  # once the first holds its place
                assert time.monotonic() < deadline, r.text[:200]
                await asyncio.sleep(0.1)
            assert "sockets" in r.json()["error"]["message"]
            # The victim: another tenant, a whole answer, while the attack holds.
            victim = await client.post(
                f"{api.http_url}/v1/chat/completions",
                headers=auth(api, TWO_STREAMS),
                json={**echo_request("still served", 4), "stream": False},
            )
            assert victim.status_code == 200, victim.text[:200]
        # And the held ones time out as any slow body does.
        assert [await a for a in held] == [408, 408]
    finally:
        for writer in HELD:
            await closed(writer)
        HELD.clear()


async def closed(writer: asyncio.StreamWriter) -> None:
    """Close a connection and wait until its socket is: a transport closed but not waited for
    may outlive the test's event loop, and its socket warns when collected in a later test."""
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()
