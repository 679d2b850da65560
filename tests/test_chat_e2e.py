"""End to end through a real broker: edge -> ingest -> scheduler -> worker -> edge."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import websockets

from services.worker.engines.sim_text import complete
from shared.messages import ChatMessage, ChatRequest
from tests.chat_client import Transcript, recv_json, run_requests
from tests.stack import Stack


def expected(request: dict[str, Any]) -> tuple[str, int, str]:
    body = ChatRequest.model_validate(request)
    plan = complete(
        body.prompt_text(),
        body.effective_max_tokens,
        tuple(body.stop),
        body.temperature,
        body.top_p,
    )
    return plan.text, plan.completion_tokens, plan.finish_reason


def check_transcript(t: Transcript, request: dict[str, Any]) -> None:
    assert len(t.accepted) == 1, t.frames
    assert t.frames[0]["type"] == "chat.accepted", "chat.accepted must come first"
    assert t.accepted[0]["resume_token"]
    seqs = [d["seq"] for d in t.deltas]
    assert seqs == list(range(len(seqs))), f"seq out of order: {seqs}"
    done = [f for f in t.frames if f["type"] == "chat.done"]
    assert len(done) == 1, t.frames
    assert t.frames[-1] is done[0], "chat.done must be the last frame"
    text, tokens, finish = expected(request)
    assert t.text == text
    assert done[0]["usage"]["completion_tokens"] == tokens
    assert done[0]["finish_reason"] == finish
    assert done[0]["usage"]["prompt_tokens"] > 0
    assert done[0]["timings"]["batch_size"] >= 1


def make_request(i: int) -> dict[str, Any]:
    if i % 2:
        return {
            "client_id": f"c{i}",
            "prompt": f"tell me about buses, number {i}",
            "max_tokens": 30,
        }
    messages = [
        ChatMessage(role="system", content="be brief").model_dump(),
        ChatMessage(role="user", content=f"question {i}: why kafka?").model_dump(),
    ]
    return {"client_id": f"c{i}", "messages": messages, "max_tokens": 200}


async def test_twenty_concurrent_requests_on_one_socket(stack: Stack) -> None:
    requests = [make_request(i) for i in range(20)]
    async with websockets.connect(stack.ws_url) as ws:
        transcripts = await run_requests(ws, requests)
    for r in requests:
        check_transcript(transcripts[r["client_id"]], r)


async def test_twenty_sockets_one_request_each(stack: Stack) -> None:
    requests = [make_request(100 + i) for i in range(20)]

    async def one(request: dict[str, Any]) -> Transcript:
        async with websockets.connect(stack.ws_url) as ws:
            return (await run_requests(ws, [request]))[request["client_id"]]

    transcripts = await asyncio.gather(*(one(r) for r in requests))
    for r, t in zip(requests, transcripts, strict=True):
        check_transcript(t, r)


async def test_stop_and_max_tokens_are_honoured(stack: Stack) -> None:
    probe = {"client_id": "probe", "prompt": "stop test", "max_tokens": 500}
    full, _, _ = expected(probe)
    stop_word = full.split()[5]
    requests = [
        {"client_id": "stop", "prompt": "stop test", "max_tokens": 500, "stop": [stop_word]},
        {"client_id": "len", "prompt": "stop test", "max_tokens": 3},
    ]
    async with websockets.connect(stack.ws_url) as ws:
        transcripts = await run_requests(ws, requests)
    check_transcript(transcripts["stop"], requests[0])
    assert stop_word not in transcripts["stop"].text
    assert transcripts["stop"].final is not None
    assert transcripts["stop"].final["finish_reason"] == "stop"
    check_transcript(transcripts["len"], requests[1])
    assert transcripts["len"].final is not None
    assert transcripts["len"].final["finish_reason"] == "length"
    assert transcripts["len"].final["usage"]["completion_tokens"] == 3


async def test_chat_page_and_health_are_served(stack: Stack) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=stack.http_url) as client:
        health = await client.get("/healthz")
        ready = await client.get("/readyz")
        page = await client.get("/")
        script = await client.get("/static/chat.js")
    assert health.status_code == 200
    assert health.json() == {"status": "alive"}
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    assert page.status_code == 200
    assert "/static/chat.js" in page.text
    assert script.status_code == 200
    assert "/v1/chat" in script.text


async def test_background_priority_is_accepted_on_its_tier(stack: Stack) -> None:
    request = {"client_id": "bg", "prompt": "batch job", "max_tokens": 5, "priority": "background"}
    async with websockets.connect(stack.ws_url) as ws:
        transcripts = await run_requests(ws, [request])
    t = transcripts["bg"]
    assert t.accepted[0]["tier"] == "background"
    check_transcript(t, request)


async def test_a_made_up_key_is_refused_and_nothing_is_served(stack: Stack) -> None:
    async with websockets.connect(stack.ws_url_as(None)) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": "sk-test"}))
        frame = await recv_json(ws)
        assert (frame["type"], frame["code"]) == ("error", "unauthorized"), frame
        request = {"type": "chat.request", "client_id": "a", "prompt": "hi", "max_tokens": 4}
        await ws.send(json.dumps(request))
        frame = await recv_json(ws)
        assert (frame["type"], frame["code"], frame["client_id"]) == ("error", "unauthorized", "a")


async def test_auth_frame_with_a_valid_key_is_accepted(stack: Stack) -> None:
    async with websockets.connect(stack.ws_url_as(None)) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": stack.keys["alice"]}))
        transcripts = await run_requests(ws, [{"client_id": "a", "prompt": "hi", "max_tokens": 4}])
        assert transcripts["a"].final is not None
        assert transcripts["a"].final["type"] == "chat.done"
        await ws.send(json.dumps({"type": "chat.cancel", "request_id": "nope"}))
        frame = await recv_json(ws)
        assert frame["type"] == "error"
        assert frame["code"] == "not_found"
