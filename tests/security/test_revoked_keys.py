"""A revoked key's open socket is closed within a second (issue 24, lows).

On main (456a15c) a key revoked in the keys file refused new sockets and new requests, but a
socket already open went on: it read its streams to the end and could still send
`stream.resume` and `chat.cancel` (neither was checked against the keys file).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from tests.chat_client import recv_json
from tests.stack import Stack, new_prefix, wait_until
from tokenbus.cli import main as tokenbus

REVOKED_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def stack(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    s = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        tenant_limits={"eve": {"rps": 100.0}},
        # A 400-token answer streams for 20 s: the socket is busy when its key goes.
        env_overrides={"TOKENBUS_WORKER_SIM_TOKEN_RATE": "20"},
    )
    try:
        yield s.start()
    finally:
        s.stop()


def test_a_revoked_keys_busy_socket_is_closed_within_a_second(stack: Stack) -> None:
    async def attack() -> tuple[float, int]:
        async with websockets.connect(stack.ws_url_as("eve")) as ws:
            await ws.send(
                json.dumps(
                    {"type": "chat.request", "client_id": "c", "prompt": "p", "max_tokens": 400}
                )
            )
            accepted = await recv_json(ws)
            assert accepted["type"] == "chat.accepted", accepted
            assert (await recv_json(ws))["type"] == "chat.delta"
            assert (
                tokenbus(["keys", "--file", str(stack.keys_file), "revoke", stack.keys["eve"]]) == 0
            )
            revoked_at = time.monotonic()
            # The attacker keeps using the socket: a resume and a cancel, then reads on.
            resume = {"type": "stream.resume", "resume_token": accepted["resume_token"]}
            try:
                await ws.send(json.dumps(resume))
                while True:
                    await recv_json(ws, timeout=10)
            except ConnectionClosed:
                pass
            assert ws.close_code is not None
            return time.monotonic() - revoked_at, ws.close_code

    took, code = asyncio.run(attack())
    assert code == 1008
    # The check runs every 0.5 s; a busy 2-core machine gets the margin.
    assert took < REVOKED_WITHIN_S + 1.0, f"closed {took:.2f} s after the revocation"


def test_a_revoked_keys_sse_stream_and_waiting_answer_end_within_a_second(stack: Stack) -> None:
    """Issue 37 (Low): the WebSocket above was closed, but an OpenAI SSE stream (and a
    whole answer still waited for) of a revoked key went on to its end. Now both stop: the
    stream's body ends, the waiting answer is a 401. (Two tenants' keys: one each.)"""
    ask = {
        "model": "sim-8b",
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": 400,  # 20 s at the stack's 20 tokens/s
    }

    def revoke(tenant: str) -> float:
        assert tokenbus(["keys", "--file", str(stack.keys_file), "revoke", stack.keys[tenant]]) == 0
        return time.monotonic()

    def client_of(tenant: str) -> httpx.Client:
        auth = {"Authorization": f"Bearer {stack.keys[tenant]}"}
        return httpx.Client(base_url=stack.http_url, headers=auth, timeout=60)

    with (
        client_of("mallory") as http,
        http.stream("POST", "/v1/chat/completions", json={**ask, "stream": True}) as sse,
    ):
        assert sse.status_code == 200
        lines = sse.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        revoked_at = revoke("mallory")
        rest = list(lines)  # read on: it ends when the edge lets the stream go
        took = time.monotonic() - revoked_at
    errors = [json.loads(x[6:]) for x in rest if x.startswith("data: {") and '"error"' in x]
    assert errors, rest[-3:]
    assert errors[-1]["error"]["code"] == "invalid_api_key", errors[-1]  # OpenAI's 401 code
    assert "revoked" in errors[-1]["error"]["message"]
    assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]", rest[-3:]
    assert took < REVOKED_WITHIN_S + 1.0, f"the SSE stream ran {took:.2f} s past the revocation"

    def streams_open() -> float:
        found = re.search(r"^tokenbus_edge_streams_open ([0-9.]+)$", stack.edge_metrics(), re.M)
        return float(found.group(1)) if found else 0.0

    wait_until(lambda: streams_open() == 0, 30, "mallory's stream gone from the edge")
    with client_of("bob") as http, ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(http.post, "/v1/chat/completions", json=ask)

        def under_way() -> bool:  # accepted: its answer then takes 20 s
            if waiting.done():
                raise AssertionError(f"answered before the revocation: {waiting.result().text}")
            return streams_open() == 1

        wait_until(under_way, 10, "bob's answer under way")
        revoked_at = revoke("bob")
        answer = waiting.result(timeout=30)
        took = time.monotonic() - revoked_at
    assert answer.status_code == 401, answer.text
    assert "revoked" in answer.json()["error"]["message"]
    assert took < REVOKED_WITHIN_S + 1.0, f"answered {took:.2f} s after the revocation"
