"""A client that stops reading: the edge's memory stays bounded and other clients' streams
flow as before (the edge's one result reader never waits for a socket).

The slow client is a raw socket (small receive buffer) that sends requests and never reads.
Kernel buffers on both sides take a few MB first; past them the edge's per-socket outbox
fills, and the edge must then let go of the socket (close 1013, streams detached for resume)
instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from bench.stats import percentile
from services.worker.engines.sim_text import complete
from tests.chat_client import recv_json
from tests.stack import Stack, new_prefix

TOKEN_RATE = 100  # sim tokens/s per sequence; with one token per chunk: a delta every 10 ms
WAVE = 200  # requests of max_tokens 4096 the slow client sends at a time
MAX_WAVES = 6
RSS_GROWTH_LIMIT_KB = 50 * 1024
WATCH_PROMPT = "outage stream 11"  # 117 tokens: about 1.2 s per request


@pytest.fixture(scope="module")
def slow_stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": str(TOKEN_RATE),
            "TOKENBUS_WORKER_FLUSH_TOKENS": "1",  # a frame per token: the most frames
            "TOKENBUS_EDGE_OUTBOX_FRAMES": "1024",
            # The slow client's detached streams are cancelled soon after it is let go.
            "TOKENBUS_EDGE_DISCONNECT_GRACE_S": "1",
        },
    )
    try:
        yield stack.start()
    finally:
        stack.stop()


class NeverReads:
    """A WebSocket client on a plain socket: sends text frames, never reads a byte after
    the handshake."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /v1/chat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        response = b""
        while b"\r\n\r\n" not in response:  # byte by byte: leave every frame unread
            response += self.sock.recv(1)
        assert b" 101 " in response.split(b"\r\n")[0], response
        # Never wait long on a send: once the edge lets go, nobody reads what is sent.
        self.sock.settimeout(5)

    def send_text(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        size = len(payload)
        if size < 126:
            header = bytes([0x81, 0x80 | size])
        else:
            header = bytes([0x81, 0x80 | 126]) + size.to_bytes(2, "big")
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def close(self) -> None:
        self.sock.close()


def rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert found, status
    return int(found.group(1))


def metric(stack: Stack, name: str) -> float:
    text = stack.edge_metrics()
    found = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def gaps_while(stack: Stack, done: asyncio.Event, at_least: int) -> list[float]:
    """Seconds between consecutive deltas of each stream of a well-behaved client, over
    requests sent one after the other until `done` (and at least `at_least` of them)."""
    gaps: list[float] = []
    sent = 0
    async with websockets.connect(stack.ws_url) as ws:
        while sent < at_least or not done.is_set():
            request = {"type": "chat.request", "client_id": str(sent), "prompt": WATCH_PROMPT}
            await ws.send(json.dumps({**request, "max_tokens": 500}))
            sent += 1
            last: float | None = None
            while True:
                frame = await recv_json(ws, 60)
                now = time.monotonic()
                if frame["type"] == "chat.delta":
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                elif frame["type"] in ("chat.done", "error"):
                    assert frame["type"] == "chat.done", frame
                    break
    return gaps


async def test_a_client_that_stops_reading_is_let_go_without_growing_the_edge(
    slow_stack: Stack,
) -> None:
    stack = slow_stack
    edge_pid = stack.processes["edge"].pid
    assert complete(WATCH_PROMPT, 500).completion_tokens > 100
    # Warm up (first requests pay for connections and metadata), then the baseline.
    await gaps_while(stack, _set(), 1)
    baseline = await gaps_while(stack, _set(), 4)
    rss_before = rss_kb(edge_pid)

    slow = NeverReads(stack.edge_port)
    flooding = asyncio.Event()
    watch = asyncio.create_task(gaps_while(stack, flooding, 4))
    rss_peak = rss_before
    let_go = False
    try:
        for wave in range(MAX_WAVES):
            request = {"type": "chat.request", "prompt": "slow reader", "max_tokens": 4096}
            try:
                for i in range(WAVE):
                    slow.send_text(json.dumps({**request, "client_id": f"{wave}-{i}"}))
            except TimeoutError:
                pass  # the edge stopped reading it: the metric says why
            except OSError:
                let_go = True  # the edge dropped the connection
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not let_go:
                rss_peak = max(rss_peak, rss_kb(edge_pid))
                let_go = metric(stack, "tokenbus_edge_slow_client_closes") >= 1
                await asyncio.sleep(0.5)
            if let_go:
                break
        assert let_go, f"the edge still holds a socket that read nothing after {MAX_WAVES} waves"
        # Its streams were detached, then cancelled after the grace: the flood ends.
        settle = time.monotonic() + 10
        while time.monotonic() < settle:
            rss_peak = max(rss_peak, rss_kb(edge_pid))
            await asyncio.sleep(0.5)
    finally:
        flooding.set()
        slow.close()
    during = await asyncio.wait_for(watch, 120)

    growth = rss_peak - rss_before
    base, flood = percentile(sorted(baseline), 99), percentile(sorted(during), 99)
    print(  # for the record (pytest -s): what this run measured
        f"slow client: edge RSS +{growth / 1024:.1f} MB; p99 gap {base * 1000:.0f} ms"
        f" before, {flood * 1000:.0f} ms during ({len(during)} gaps)"
    )
    assert growth < RSS_GROWTH_LIMIT_KB, f"edge RSS grew by {growth / 1024:.1f} MB"
    # Unchanged within what a shared 2-core machine allows (the flood's own generation
    # competes for the CPU): a reader waiting on the slow socket would stall this stream
    # for as long as the socket is held, seconds at least.
    limit = max(5 * base, base + 1.0)
    assert flood < limit, f"p99 gap {flood * 1000:.0f} ms, before {base * 1000:.0f} ms"


def _set() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event
