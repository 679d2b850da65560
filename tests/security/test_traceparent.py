"""A client's `traceparent` does not choose the edge's trace unless configured: an attacker
cannot join its requests to another's trace, or force their sampling, by naming a trace id.
(Configured trust, TOKENBUS_EDGE_TRUST_TRACEPARENT=true: test_openai_api.py.)"""

from __future__ import annotations

import uuid

import httpx
import websockets

from tests.chat_client import run_requests
from tests.stack import Stack
from tests.test_openai_api import read_with_headers

MODEL = "sim-8b"


async def test_an_http_clients_traceparent_is_not_continued(stack: Stack) -> None:
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    text = f"hello {uuid.uuid4().hex}"
    async with httpx.AsyncClient(timeout=60) as client:
        got = await client.post(
            f"{stack.http_url}/v1/chat/completions",
            headers={
                "Authorization": f"Bearer {stack.keys['default']}",
                "traceparent": f"00-{trace_id}-{parent_id}-01",
            },
            json={"messages": [{"role": "user", "content": text}], "max_tokens": 2},
        )
    assert got.status_code == 200, got.text[:200]
    records = [r for t in stack.request_topics for r in await read_with_headers(stack, t)]
    (headers,) = [h for value, h in records if text.encode() in value]
    # The edge's own trace, or none where the stack records none: never the client's.
    assert trace_id not in headers.get("traceparent", ""), "the client chose the edge's trace"


async def test_a_sockets_traceparent_is_not_continued(stack: Stack) -> None:
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    text = f"hello {uuid.uuid4().hex}"
    async with websockets.connect(
        stack.ws_url, additional_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}
    ) as ws:
        (done,) = (
            await run_requests(
                ws, [{"client_id": "c", "messages": [{"role": "user", "content": text}]}]
            )
        ).values()
    assert done.final is not None
    assert done.final["type"] == "chat.done", done.final
    records = [r for t in stack.request_topics for r in await read_with_headers(stack, t)]
    (headers,) = [h for value, h in records if text.encode() in value]
    assert trace_id not in headers.get("traceparent", ""), "the client chose the edge's trace"
