"""`tokenbus.client` against a real stack with two edges: kill -9 the edge serving the SDK
mid-stream and the caller still gets the whole answer, once; cancel; a dead edge skipped.

On the session's shared stack: the two edges are the module's own (the one it kills among
them), and the answers that must last are paced to 20 tokens a second by the sim's pace
marker."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from services.edge.resume import verify
from services.worker.engines.sim_text import complete
from shared.kafka import encode, key_of, make_producer
from shared.messages import (
    CancelRecord,
    ChatMessage,
    ChatRequest,
    DeltaResult,
    DoneResult,
    ResetResult,
    Timings,
    Usage,
)
from tests.stack import Stack, free_port, wait_until
from tests.tenants import paced
from tokenbus.client import ChatError, Client, ConnectionLost, Delta

TOKEN_RATE = 20  # sim tokens/s: a delta every 50 ms, so "mid-stream" lasts seconds
EDGE_A = "edge-client-a"  # the module's edges of the shared stack: A is the one killed


@dataclass
class TwoEdges:
    stack: Stack
    port_a: int
    port_b: int

    @property
    def url_a(self) -> str:
        return self.stack.ws_url_as(None, port=self.port_a)

    @property
    def url_b(self) -> str:
        return self.stack.ws_url_as(None, port=self.port_b)

    def client(self, *urls: str, **options: float) -> Client:
        return Client(list(urls), api_key=self.stack.keys["default"], **options)


@pytest.fixture(scope="module")
def edges(stack: Stack) -> Iterator[TwoEdges]:
    with stack.own_edge(EDGE_A) as port_a, stack.own_edge("edge-client-b") as port_b:
        yield TwoEdges(stack, port_a, port_b)


def expected(messages: list[dict[str, str]], max_tokens: int) -> str:
    request = ChatRequest(messages=[ChatMessage.model_validate(m) for m in messages])
    return complete(request.prompt_text(), max_tokens).text


async def test_the_edge_killed_mid_stream_the_sdk_yields_the_whole_text_once(
    edges: TwoEdges,
) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": paced("what happens when an edge dies", TOKEN_RATE)},
    ]
    n = 60
    stack = edges.stack
    client = edges.client(edges.url_a, edges.url_b)
    stream = client.chat(messages, max_tokens=n)
    deltas: list[Delta] = []
    killed_after = -1
    try:
        async for delta in stream:
            deltas.append(delta)
            if len(deltas) == 5:
                stack.stop_service(EDGE_A, signal.SIGKILL)  # serving the stream
                killed_after = len(deltas)
    finally:
        if stack.processes[EDGE_A].poll() is not None:
            stack.start_service("edge", key=EDGE_A, TOKENBUS_EDGE_PORT=str(edges.port_a))
            wait_until(lambda: stack.edge_ready(edges.port_a), 60, "edge A back")
    text = expected(messages, n)
    assert killed_after == 5
    assert stream.url == edges.url_b, "the stream moved to edge B"
    assert stream.reconnects >= 1
    assert not any(d.reset for d in deltas)
    assert [d.seq for d in deltas] == list(range(len(deltas))), "each delta once, in order"
    assert "".join(d.text for d in deltas) == text == stream.text
    assert stream.done is not None
    assert stream.done.usage.completion_tokens == len(deltas)


async def test_a_re_run_is_shown_as_a_reset_and_then_only_the_new_attempt(
    edges: TwoEdges,
) -> None:
    # A re-run as the scheduler announces it (a reset record, then the new attempt's
    # records), written into the stream while the worker's attempt 0 still writes on.
    stack = edges.stack
    prompt = paced("a re-run mid-stream", TOKEN_RATE)
    stream = edges.client(edges.url_a).chat(prompt, max_tokens=200)
    deltas: list[Delta] = []
    producer = make_producer(stack.settings, client_id="injector")
    await producer.start()
    rid = ""
    try:
        async for delta in stream:
            deltas.append(delta)
            if len(deltas) != 2:
                continue
            assert stream.state.resume_token is not None
            claims = verify(stream.state.resume_token, stack.resume_keys, now=time.time())
            rid = claims.request_id
            usage = Usage(prompt_tokens=4, completion_tokens=2)
            timings = Timings(queue_ms=0, batch_size=1, ttft_ms=1, total_ms=1)
            for record in (
                ResetResult(request_id=rid, attempt=1),
                DeltaResult(request_id=rid, attempt=1, seq=0, text="second "),
                DeltaResult(request_id=rid, attempt=1, seq=0, text="DUPLICATE"),
                DeltaResult(request_id=rid, attempt=1, seq=1, text="try."),
                DoneResult(
                    request_id=rid,
                    attempt=1,
                    seq=2,
                    finish_reason="stop",
                    usage=usage,
                    timings=timings,
                ),
            ):
                await producer.send_and_wait(
                    claims.topic, encode(record), key=key_of(rid), partition=claims.partition
                )
    finally:
        if rid:  # the worker's attempt 0 stops
            await producer.send_and_wait(
                stack.topics.control, encode(CancelRecord(request_id=rid)), key=key_of(rid)
            )
        await producer.stop()
    resets = [i for i, d in enumerate(deltas) if d.reset]
    assert len(resets) == 1, deltas
    assert all(d.attempt == 0 for d in deltas[: resets[0]])
    assert [(d.attempt, d.seq, d.text) for d in deltas[resets[0] + 1 :]] == [
        (1, 0, "second "),
        (1, 1, "try."),
    ]
    assert stream.text == "second try."
    assert stream.done is not None


async def test_cancel_ends_the_stream_without_an_error(edges: TwoEdges) -> None:
    prompt, n = paced("cancel me from the sdk", TOKEN_RATE), 200
    plan = complete(prompt, n)
    assert plan.completion_tokens > 20, "the answer must outlast the cancel"
    stream = edges.client(edges.url_a).chat(prompt, max_tokens=n)
    deltas = []
    async for delta in stream:
        deltas.append(delta)
        if len(deltas) == 2:
            await stream.cancel()
    assert stream.done is None
    assert stream.state.end is not None
    assert stream.state.end.code == "cancelled"
    assert len(deltas) < plan.completion_tokens
    assert plan.text.startswith(stream.text)


async def test_an_edge_that_is_down_is_skipped(edges: TwoEdges) -> None:
    dead = f"ws://127.0.0.1:{free_port()}/v1/chat"
    client = edges.client(dead, edges.url_b)
    messages = [{"role": "user", "content": "hello"}]
    assert await client.complete(messages, max_tokens=8) == expected(messages, 8)


async def test_a_wrong_key_is_unauthorized_at_once(edges: TwoEdges) -> None:
    client = Client(edges.url_a, api_key="tb_not-a-key")
    with pytest.raises(ChatError) as refused:
        await client.complete("hello", max_tokens=4)
    assert refused.value.code == "unauthorized"


async def test_no_edge_answering_is_connection_lost_after_the_reconnect_timeout() -> None:
    dead = [f"ws://127.0.0.1:{free_port()}/v1/chat" for _ in range(2)]
    client = Client(dead, api_key="tb_any", reconnect_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(ConnectionLost, match="no edge"):
        await client.complete("hello", max_tokens=4)
    assert time.monotonic() - started >= 1.0
