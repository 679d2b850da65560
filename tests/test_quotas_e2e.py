"""Each tenant quota on a real stack: the request past it gets `rate_limited` with a retry
hint, and nothing of it reaches Kafka.

On the session's shared stack: each quota has a tenant of its own there (`tests/tenants.py`,
`QUOTAS`), and each test looks for its own prompts on Kafka."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import websockets
from websockets.exceptions import ConnectionClosed

from tests.chat_client import bearer, close_of, recv_json, run_requests
from tests.stack import Stack


def marker() -> str:
    return "quota-" + uuid.uuid4().hex


async def send(ws: websockets.ClientConnection, client_id: str, prompt: str, n: int) -> None:
    request = {"client_id": client_id, "prompt": prompt, "max_tokens": n}
    await ws.send(json.dumps({"type": "chat.request", **request}))


def check_rate_limited(frame: dict[str, Any], client_id: str, limit: str) -> None:
    assert (frame["type"], frame["code"]) == ("error", "rate_limited"), frame
    assert frame["client_id"] == client_id
    assert f"({limit})" in frame["message"], frame


async def test_requests_per_second(stack: Stack) -> None:
    prompts = [marker() for _ in range(3)]
    async with websockets.connect(stack.ws_url_as(None), **bearer(stack, "quota-slow")) as ws:
        for i, prompt in enumerate(prompts):
            await send(ws, f"c{i}", prompt, 3)
        frames = [await recv_json(ws) for _ in range(3)]
        refused = [f for f in frames if f["type"] == "error"]
        assert len(refused) == 1, frames
        check_rate_limited(refused[0], "c2", "rps")
        assert 1 <= refused[0]["retry_after_ms"] <= 100_000
        # Both accepted requests still complete.
        while sum(f["type"] == "chat.done" for f in frames) < 2:
            frames.append(await recv_json(ws))
    on_kafka = await stack.requested_prompts()
    assert sorted(prompts[:2]) == sorted(p for p in on_kafka if p in prompts)


async def test_concurrent_streams(stack: Stack) -> None:
    long, refused, after = marker(), marker(), marker()
    async with websockets.connect(stack.ws_url_as(None), **bearer(stack, "quota-single")) as ws:
        await send(ws, "long", long, 2000)  # 10 s at the stack's 200 tokens/s
        accepted = await recv_json(ws)
        assert accepted["type"] == "chat.accepted", accepted
        await send(ws, "more", refused, 3)
        while (frame := await recv_json(ws))["type"] == "chat.delta":
            pass
        check_rate_limited(frame, "more", "concurrency")
        assert frame["retry_after_ms"] >= 1
        # The slot is free once the stream ends (here: cancelled).
        cancel = {"type": "chat.cancel", "request_id": accepted["request_id"]}
        await ws.send(json.dumps(cancel))
        while (frame := await recv_json(ws))["type"] == "chat.delta":
            pass
        assert (frame["type"], frame["code"]) == ("error", "cancelled"), frame
        done = await run_requests(ws, [{"client_id": "after", "prompt": after, "max_tokens": 3}])
        assert done["after"].final is not None
        assert done["after"].final["type"] == "chat.done", done["after"].frames
    on_kafka = await stack.requested_prompts()
    assert long in on_kafka
    assert after in on_kafka
    assert refused not in on_kafka


async def test_tokens_per_minute(stack: Stack) -> None:
    first, second, huge = marker(), marker(), marker()
    async with websockets.connect(stack.ws_url_as(None), **bearer(stack, "quota-frugal")) as ws:
        # Charged at admission: the prompt's 38 bytes + 40 for the template (shared/tokens.py)
        # + 24 = 102 of 150; settled at its end to its real usage: 3 (the sim's count) + 24
        # (at most 24: every sim answer is longer).
        done = await run_requests(ws, [{"client_id": "a", "prompt": first, "max_tokens": 24}])
        assert done["a"].final is not None
        assert done["a"].final["type"] == "chat.done"
        assert done["a"].final["usage"]["completion_tokens"] == 24
        # 123 left; the whole minute's 150 do not fit until the bucket refills (~11 s).
        await send(ws, "b", second, 72)
        frame = await recv_json(ws)
        check_rate_limited(frame, "b", "tokens_per_min")
        assert 1 <= frame["retry_after_ms"] <= 60_000
        # More than the whole minute's budget: no retry helps, so it is the client's error
        # (issue 37: a `rate_limited` told clients to retry what can never succeed).
        await send(ws, "c", huge, 200)
        frame = await recv_json(ws)
        assert (frame["type"], frame["code"]) == ("error", "invalid_request"), frame
        assert frame["client_id"] == "c"
        assert "(tokens_per_min)" in frame["message"], frame
        assert "max_tokens" in frame["message"], frame
        assert frame["retry_after_ms"] is None
        # So is a max_tokens no batch could hold, whatever the tenant's limits: named as the
        # batch budget's, not the quota's.
        await send(ws, "d", huge, 10**6)
        frame = await recv_json(ws)
        assert (frame["type"], frame["code"]) == ("error", "invalid_request"), frame
        assert "batch token budget" in frame["message"], frame
    on_kafka = await stack.requested_prompts()
    assert first in on_kafka
    assert second not in on_kafka
    assert huge not in on_kafka


async def test_open_sockets(stack: Stack) -> None:
    url, auth = stack.ws_url_as(None), bearer(stack, "quota-twosockets")
    refused = marker()
    async with websockets.connect(url, **auth), websockets.connect(url, **auth):
        async with websockets.connect(url, **auth) as third:
            # The edge may close it before the request is even sent: either way, refused.
            with contextlib.suppress(ConnectionClosed):
                await send(third, "x", refused, 3)
            code, reason = await close_of(third)
        assert code == 1013, reason
        assert reason.startswith("rate_limited"), reason
        # The same by `auth` frame, as the chat page authenticates.
        async with websockets.connect(url) as fourth:
            await fourth.send(
                json.dumps({"type": "auth", "api_key": stack.keys["quota-twosockets"]})
            )
            code, reason = await close_of(fourth)
        assert code == 1013, reason

    # Closed sockets give their places back (the edge notices the close a moment later).
    async def opens() -> bool:
        try:
            async with websockets.connect(url, **auth) as ws:
                await send(ws, "y", "after", 3)
                return str((await recv_json(ws))["type"]) == "chat.accepted"
        except ConnectionClosed:
            return False

    deadline = time.monotonic() + 20
    while not await opens():
        assert time.monotonic() < deadline, "closed sockets were not given back"
        await asyncio.sleep(0.1)
    assert refused not in await stack.requested_prompts()
