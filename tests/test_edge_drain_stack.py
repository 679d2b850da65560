"""SIGTERM drains the edge (issue 38, item 3; services/edge/drain.py), on a real edge.

Before, SIGTERM cut every connection: a WebSocket resumed elsewhere, but an OpenAI SDK
stream failed, and the SDK sent a whole-answer call again as a new request. Now: `/readyz`
turns 503 and new requests are refused at once; a stream that ends within the drain bound
ends as if nothing happened; at the bound a socket closes 1012, an SSE stream ends with an
`edge_restarting` event naming the event to go on from, a whole answer still running is a
503 `edge_restarting`; each goes on at another edge, every character once; and the edge
exits by itself.

On the session's shared stack, with an edge of the module's own (drain bound 3 s), answers
paced by the sim's marker (tests/tenants.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import websockets

from services.worker.engines.sim_text import complete
from tests.chat_client import recv_json
from tests.stack import Stack
from tests.tenants import paced

DRAIN_S = 3.0
RATE = 40  # tokens/s: a long answer (240 tokens) outlives the drain, a short one (12) not
LONG, SHORT = 240, 12
MODEL = "sim-8b"


@pytest.fixture(scope="module")
def edge(stack: Stack) -> Iterator[int]:
    with stack.own_edge("edge-drain", TOKENBUS_EDGE_DRAIN_S=str(DRAIN_S)) as port:
        yield port


def chat_body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,  # as long as asked: a long one outlives the drain
    }


def sse_events(lines: list[str]) -> list[tuple[str | None, Any]]:
    """(id, data) of each event in `lines` (keep-alives skipped)."""
    out: list[tuple[str | None, Any]] = []
    event_id, data = None, None
    for line in [*lines, ""]:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
        elif not line and data is not None:
            out.append((event_id, data if data == "[DONE]" else json.loads(data)))
            event_id, data = None, None
    return out


def content(events: list[tuple[str | None, Any]]) -> str:
    return "".join(
        d["choices"][0]["delta"].get("content") or ""
        for _, d in events
        if isinstance(d, dict) and d.get("choices")
    )


async def test_sigterm_drains_the_edge_and_every_answer_goes_on_at_another(
    stack: Stack, edge: int
) -> None:
    key = stack.keys["default"]
    auth = {"Authorization": f"Bearer {key}"}
    prompts = {
        name: paced(f"drain {name} {time.time_ns()}", RATE)
        for name in ("ws", "sse", "whole", "short")
    }
    draining = f"http://127.0.0.1:{edge}"
    async with (
        httpx.AsyncClient(timeout=30) as http,
        websockets.connect(stack.ws_url_as("default", edge)) as ws,
    ):
        # A long stream over each API, and a whole answer, all under way on the edge.
        long = {
            "client_id": "long",
            "prompt": prompts["ws"],
            "max_tokens": LONG,
            "ignore_eos": True,
        }
        await ws.send(json.dumps({"type": "chat.request", **long}))
        accepted = await recv_json(ws)
        assert accepted["type"] == "chat.accepted", accepted
        shown = [await recv_json(ws)]
        sse = http.stream(
            "POST",
            f"{draining}/v1/chat/completions",
            json=chat_body(prompts["sse"], LONG, True),
            headers=auth,
        )
        async with sse as response:
            assert response.status_code == 200
            token = response.headers["X-Tokenbus-Resume-Token"]
            whole = asyncio.create_task(
                http.post(
                    f"{draining}/v1/chat/completions",
                    json=chat_body(prompts["whole"], LONG, False),
                    headers=auth,
                )
            )
            lines: list[str] = []
            reading = asyncio.create_task(_read_lines(response, lines))
            await until(lambda: len(content(sse_events(lines))) > 8, "the SSE stream's text")
            # One that ends within the drain bound, accepted just before the signal.
            short = {"client_id": "short", "prompt": prompts["short"], "max_tokens": SHORT}
            await ws.send(json.dumps({"type": "chat.request", **short}))
            frames: list[dict[str, Any]] = []
            while not any(f.get("client_id") == "short" for f in frames):
                frames.append(await recv_json(ws))
            os.killpg(stack.processes["edge-drain"].pid, signal.SIGTERM)
            signalled = time.monotonic()

            # Not ready within moments (the signal is taken on the edge's next loop turn), and
            # from then on a new request is refused, as overloaded.
            readiness: list[int] = []

            async def not_ready() -> bool:
                readiness.append((await http.get(f"{draining}/readyz")).status_code)
                return readiness[-1] == 503

            deadline = time.monotonic() + 2.0
            while not await not_ready():
                assert time.monotonic() < deadline, readiness
                await asyncio.sleep(0.02)
            refused = await http.post(
                f"{draining}/v1/chat/completions", json=chat_body("late", 4, False), headers=auth
            )
            assert refused.status_code == 503, refused.text
            # vLLM's health check, as guidellm and load balancers ask it: not healthy either.
            assert (await http.get(f"{draining}/health")).status_code == 503

            # The socket: the short answer whole, then the close 1012 at the bound.
            code = await read_until_closed(ws, frames, DRAIN_S + 10)
            assert code == 1012
            assert time.monotonic() - signalled >= DRAIN_S - 0.5
            short_id = next(f["request_id"] for f in frames if f.get("client_id") == "short")
            assert any(
                f["type"] == "chat.done" and f.get("request_id") == short_id for f in frames
            ), frames

            await asyncio.wait_for(reading, DRAIN_S + 10)
        events = sse_events(lines)
        *_, (last_id, marker) = events
        assert isinstance(marker, dict), events[-3:]
        assert marker["error"]["code"] == "edge_restarting", marker
        assert last_id is not None
        assert f"Last-Event-ID: {last_id}" in marker["error"]["message"]
        answer = await whole
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "edge_restarting"
        await until(lambda: stack.processes["edge-drain"].poll() is not None, "the edge's exit")

        # Each goes on at the stack's own edge, every character once.
        rest = await http.post(
            f"{stack.http_url}/v1/chat/completions",
            json=chat_body(prompts["sse"], LONG, True),
            headers={**auth, "Last-Event-ID": last_id, "X-Tokenbus-Resume-Token": token},
        )
        assert rest.status_code == 200, rest.text
        after = sse_events(rest.text.splitlines())
        assert after[-1][1] == "[DONE]"
        expected_sse = complete(f"user: {prompts['sse']}", LONG, ignore_eos=True).text
        assert content(events) + content(after) == expected_sse

    deltas = [
        f
        for f in [*shown, *frames]
        if f["type"] == "chat.delta" and f["request_id"] == accepted["request_id"]
    ]
    ws_text = "".join(f["text"] for f in deltas)
    async with websockets.connect(stack.ws_url) as again:
        resume = {
            "type": "stream.resume",
            "resume_token": accepted["resume_token"],
            "after_seq": deltas[-1]["seq"],
        }
        await again.send(json.dumps(resume))
        while True:
            frame = await recv_json(again)
            if frame["type"] == "chat.delta":
                ws_text += frame["text"]
            if frame["type"] in ("chat.done", "error"):
                break
    assert frame["type"] == "chat.done", frame
    assert ws_text == complete(prompts["ws"], LONG, ignore_eos=True).text


async def read_until_closed(
    ws: websockets.ClientConnection, frames: list[dict[str, Any]], timeout_s: float
) -> int | None:
    """Read frames into `frames` until the socket closes; its close code."""
    try:
        while True:
            frames.append(await recv_json(ws, timeout=timeout_s))
    except websockets.ConnectionClosed as closed:
        return None if closed.rcvd is None else closed.rcvd.code


async def until(ready: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    """Poll `ready` without holding up the loop (the stream readers run on it)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        await asyncio.sleep(0.05)


async def _read_lines(response: httpx.Response, lines: list[str]) -> None:
    async for line in response.aiter_lines():
        lines.append(line)
