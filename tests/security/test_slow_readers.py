"""Clients that stop reading, or read slowly: the edge's memory stays bounded and other
clients' streams flow as before (the edge's one result reader never waits for a socket).

A slow client is a raw socket (small receive buffer) with the key in its upgrade, that sends
requests and reads nothing (or 64 KiB now and then). Kernel buffers on both sides take a few
MB first; past them the edge's per-socket outbox fills, and the edge must then let go of the
socket (close 1013, streams detached for resume) instead of queueing without bound.

Issue 37, N1: a delta with 20 logprobs a token is 12-183 KB as the objects the edge queues,
so an outbox bounded in frames alone let 32 slow sockets of one key fill the edge's memory;
every queued frame is now weighed, per client and for the edge as a whole. The module's
stack runs a sim that honours `logprobs` (TOKENBUS_WORKER_SIM_LOGPROBS: made-up values,
shaped and sized as vLLM's) and an edge whose budget for all clients is OUTBOX_BUDGET_BYTES.
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
from tests.tenants import RATE_MARKER, paced

TOKEN_RATE = 100  # sim tokens/s per sequence; with one token per chunk: a delta every 10 ms
WAVE = 200  # requests of max_tokens 4096 the slow client sends at a time
MAX_WAVES = 6
RSS_GROWTH_LIMIT_KB = 50 * 1024
# N1: the edge's weight budget for every client's queued frames together, and what its RSS
# may grow by while slow logprob readers press on it (the budget is an upper estimate of
# the objects' memory; kernel buffers, the result reader's records and the allocator's
# slack come on top).
OUTBOX_BUDGET_BYTES = 64 << 20
LOGPROB_RSS_GROWTH_LIMIT_KB = 192 * 1024
ATTACKERS = 32
# One stream of 4,000 tokens each (3 MB on the wire): 32 streams, the default concurrency
# of one key, within the sim's 64 slots, so that the other tenant's requests never wait for
# one (what is measured is the edge, not the worker's capacity).
STREAMS_EACH = 1
TOP_LOGPROBS = 20
READ_EVERY_S = 15.0  # 64 KiB each time
# Each attacking stream's pace: 32 of them at 25 tokens/s with 20 logprobs a token is what
# two cores carry beside the victim and the other pytest worker; faster, the machine's CPU,
# not the edge, sets its TTFT (at 50 tokens/s two clean clones measured 29 -> 60 ms once;
# at 100, 35 -> 107 ms).
ATTACK_RATE = 25
ATTACK_S = 150.0
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
            "TOKENBUS_EDGE_OUTBOX_BUDGET_BYTES": str(OUTBOX_BUDGET_BYTES),
            "TOKENBUS_WORKER_SIM_LOGPROBS": "true",
            "TOKENBUS_WORKER_SIM_RATE_MARKER": RATE_MARKER,
            # A kernel buffer of 128 KiB a socket: the attack's volume, and so its CPU on two
            # cores, is what fills the edge's outbox, not the kernel's share before it.
            "TOKENBUS_EDGE_SEND_BUFFER_BYTES": str(64 * 1024),
        },
    )
    try:
        yield stack.start()
    finally:
        stack.stop()


class NeverReads:
    """A WebSocket client on a plain socket, `key` in its upgrade: sends text frames, and
    reads nothing after the handshake unless told to (`read_some`)."""

    def __init__(self, port: int, key: str) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        nonce = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /v1/chat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {nonce}\r\n"
                f"Authorization: Bearer {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        response = b""
        while b"\r\n\r\n" not in response:  # byte by byte: leave every frame unread
            response += self.sock.recv(1)
        assert b" 101 " in response.split(b"\r\n")[0], response
        # Never wait long on a send: once the edge lets go, nobody reads what is sent.
        self.sock.settimeout(5)
        self.read = 0  # bytes read after the handshake

    def send_text(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        size = len(payload)
        if size < 126:
            header = bytes([0x81, 0x80 | size])
        else:
            header = bytes([0x81, 0x80 | 126]) + size.to_bytes(2, "big")
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def read_some(self, limit: int) -> bool:
        """Read up to `limit` bytes of what waits, without waiting; False once the edge has
        closed the connection."""
        got = 0
        try:
            while got < limit:
                chunk = self.sock.recv(min(65536, limit - got), socket.MSG_DONTWAIT)
                if not chunk:
                    return False
                got += len(chunk)
                self.read += len(chunk)
        except BlockingIOError:
            pass
        except OSError:
            return False
        return True

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

    slow = NeverReads(stack.edge_port, stack.keys["default"])
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


# -- issue 37, N1: slow readers of logprob deltas --------------------------------------------


async def ttfts_while(stack: Stack, tenant: str, done: asyncio.Event, at_least: int) -> list[float]:
    """Seconds from each request sent to its first delta, for `tenant`'s requests sent one
    after the other until `done` (and at least `at_least` of them)."""
    ttfts: list[float] = []
    async with websockets.connect(stack.ws_url_as(tenant)) as ws:
        while len(ttfts) < at_least or not done.is_set():
            prompt = f"{WATCH_PROMPT} {tenant} {len(ttfts)}"
            request = {"type": "chat.request", "client_id": str(len(ttfts)), "prompt": prompt}
            started = time.monotonic()
            await ws.send(json.dumps({**request, "max_tokens": 8}))
            first: float | None = None
            while True:
                frame = await recv_json(ws, 60)
                if frame["type"] == "chat.delta" and first is None:
                    first = time.monotonic() - started
                elif frame["type"] in ("chat.done", "error"):
                    assert frame["type"] == "chat.done", frame
                    break
            assert first is not None
            ttfts.append(first)
    return ttfts


async def test_slow_readers_of_logprob_deltas_are_let_go_at_the_edges_budget(
    slow_stack: Stack,
) -> None:
    """32 sockets of one key each run a stream asking 20 logprobs a token, and read 64 KiB
    every 15 s, as the issue's attacker did: past the kernel's buffers (128 KiB a socket
    here: TOKENBUS_EDGE_SEND_BUFFER_BYTES, doubled) their frames pile up at the edge. Each is let
    go once its outbox, or the edge's budget, is full; the edge's RSS stays within
    LOGPROB_RSS_GROWTH_LIMIT_KB of where it was, and another tenant's time to first token
    within twice its idle value (or 150 ms more, on a shared machine)."""
    stack = slow_stack
    edge_pid = stack.processes["edge"].pid
    await ttfts_while(stack, "alice", _set(), 3)  # warm up
    idle = await ttfts_while(stack, "alice", _set(), 20)
    closes_before = metric(stack, "tokenbus_edge_slow_client_closes")
    rss_before = rss_kb(edge_pid)

    attackers = [NeverReads(stack.edge_port, stack.keys["mallory"]) for _ in range(ATTACKERS)]
    attacking = asyncio.Event()
    watch = asyncio.create_task(ttfts_while(stack, "alice", attacking, 10))
    rss_peak, let_go = rss_before, 0.0
    started = next_read = time.monotonic()
    try:
        asks = {"prompt": paced("slow reader", ATTACK_RATE), "max_tokens": 4000, "ignore_eos": True}
        for i, attacker in enumerate(attackers):
            for j in range(STREAMS_EACH):
                request = {"type": "chat.request", "client_id": f"n1-{i}-{j}", **asks}
                attacker.send_text(json.dumps({**request, "logprobs": TOP_LOGPROBS}))
        while time.monotonic() < started + ATTACK_S:
            if time.monotonic() >= next_read:
                for attacker in attackers:
                    attacker.read_some(64 * 1024)
                next_read += READ_EVERY_S
            rss_peak = max(rss_peak, rss_kb(edge_pid))
            let_go = metric(stack, "tokenbus_edge_slow_client_closes") - closes_before
            if let_go >= ATTACKERS:
                break
            await asyncio.sleep(1)
        took = time.monotonic() - started
    finally:
        attacking.set()
        for attacker in attackers:
            attacker.close()
    during = await asyncio.wait_for(watch, 120)

    growth = rss_peak - rss_before
    base, attacked = percentile(sorted(idle), 90), percentile(sorted(during), 90)
    read = sum(a.read for a in attackers)
    print(  # for the record (pytest -s): what this run measured
        f"logprob slow readers: {let_go:.0f} of {ATTACKERS} let go in {took:.1f} s, having"
        f" read {read / 1e6:.1f} MB; edge RSS +{growth / 1024:.1f} MB; alice's TTFT p90"
        f" {base * 1000:.0f} ms idle, {attacked * 1000:.0f} ms attacked ({len(during)} requests)"
    )
    assert let_go >= ATTACKERS, f"{let_go:.0f} of {ATTACKERS} slow readers let go in {took:.0f} s"
    assert growth < LOGPROB_RSS_GROWTH_LIMIT_KB, f"edge RSS grew by {growth / 1024:.1f} MB"
    # Twice the idle p90, or 150 ms more: at an idle p90 of 30-45 ms, the other pytest worker
    # beside this one moves it by tens of ms on two cores (9eae431's clean clone: 34 -> 75 ms;
    # alone: 44 -> 52, 38 -> 41). A victim the edge held up behind the slow sockets would
    # wait for them: seconds.
    limit = max(2 * base, base + 0.15)
    assert attacked <= limit, f"TTFT p90 {attacked * 1000:.0f} ms, idle {base * 1000:.0f} ms"
