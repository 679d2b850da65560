"""The OpenAI-compatible API on a real stack, driven by the official `openai` SDK.

The answers equal the WebSocket's for the same prompt, usage is counted, each error status
is produced by the condition it stands for (with `X-Request-Id` and the retry hint), a
stream's headers and keep-alives go out before a slow first token, a dropped stream resumes
with `Last-Event-ID`, and a client that goes away is cancelled after the disconnect grace.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import websockets
from aiokafka import TopicPartition

from services.worker.engines.sim_text import natural_tokens
from shared.kafka import make_consumer
from shared.messages import CancelRecord
from tests.chat_client import openai_sdk, run_requests, served_models
from tests.stack import UNLIMITED, Stack, free_port, new_prefix, wait_until

GRACE_S = 3.0
# Slow enough that a long answer (100+ tokens, `long_prompt`) runs past the grace.
TOKEN_RATE = 10
MODEL = "sim-8b"  # the worker's default `worker_model`
MODEL_LEN = 8192  # the `constant` sim profile's context
# A second worker's model whose first token takes 1 / SLOW_RATE s; its context is set.
SLOW_MODEL, SLOW_RATE, SLOW_LEN = "sim-slow", 0.4, 4096
KEEPALIVE_S = 0.3
REQUEST_ID = re.compile(r"^[0-9a-f]{32}$")
TENANTS: dict[str, dict[str, object]] = {
    # Two requests, then one per 100 s: the third is refused however slow the test.
    "slow": {**UNLIMITED, "rps": 0.01, "burst": 2},
    "metered": {**UNLIMITED, "tokens_per_min": 5000},
}


@pytest.fixture(scope="module")
def api(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        tenant_limits=TENANTS,
        env_overrides={
            "TOKENBUS_EDGE_DISCONNECT_GRACE_S": str(GRACE_S),
            "TOKENBUS_WORKER_SIM_TOKEN_RATE": str(TOKEN_RATE),
            # test_a_callers_traceparent_is_continued_on_kafka: the configured trust.
            "TOKENBUS_EDGE_TRUST_TRACEPARENT": "true",
            "TOKENBUS_EDGE_SSE_KEEPALIVE_S": str(KEEPALIVE_S),
            # A request naming no model (the WebSocket's) runs on MODEL, never SLOW_MODEL.
            "TOKENBUS_SCHEDULER_DEFAULT_MODEL": MODEL,
        },
        workers={
            "worker": {},
            "worker-slow": {
                "TOKENBUS_WORKER_ID": "worker-slow",
                "TOKENBUS_WORKER_MODEL": SLOW_MODEL,
                "TOKENBUS_WORKER_SIM_TOKEN_RATE": str(SLOW_RATE),
                "TOKENBUS_WORKER_MAX_MODEL_LEN": str(SLOW_LEN),
            },
        },
    )
    try:
        stack.start()
        wait_until(
            lambda: served_models(stack) == [MODEL, SLOW_MODEL], 30, "both models on /v1/models"
        )
        yield stack
    finally:
        stack.stop()


def async_sdk(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{stack.http_url}/v1", api_key=stack.keys["default"], max_retries=0, timeout=60
    )


def prompt() -> str:
    return f"tell me about the bus {uuid.uuid4().hex}"


def long_prompt() -> str:
    """A prompt whose `sim` answer is 100+ tokens: 10+ s at the stack's token rate."""
    while True:
        text = prompt()
        if len(natural_tokens(f"user: {text}")) >= 100:
            return text


async def ws_answer(stack: Stack, request: dict[str, Any]) -> dict[str, Any]:
    """The WebSocket's answer to `request`: its text and usage."""
    async with websockets.connect(stack.ws_url) as ws:
        (t,) = (await run_requests(ws, [{"client_id": "c", **request}])).values()
    assert t.final is not None
    assert t.final["type"] == "chat.done", t.final
    return {"text": t.text, "usage": t.final["usage"], "finish": t.final["finish_reason"]}


def check_usage(usage: Any, expected: dict[str, int]) -> None:
    assert usage is not None
    assert usage.prompt_tokens == expected["prompt_tokens"] > 0
    assert usage.completion_tokens == expected["completion_tokens"] > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# -- answers ------------------------------------------------------------------------------------


async def test_models_lists_what_live_workers_advertise(api: Stack) -> None:
    assert served_models(api) == [MODEL, SLOW_MODEL]
    async with async_sdk(api) as client:
        listed = await client.models.list()
    assert [(m.id, m.object, m.owned_by) for m in listed.data] == [
        (MODEL, "model", "tokenbus"),
        (SLOW_MODEL, "model", "tokenbus"),
    ]
    # Each card's context, as its workers' heartbeats report it (vLLM's field).
    assert [(m.model_extra or {}).get("max_model_len") for m in listed.data] == [
        MODEL_LEN,
        SLOW_LEN,
    ]


def test_vllms_health_ping_and_version_answer_as_vllms_server_does(api: Stack) -> None:
    """Issue 42 item 4: guidellm checks `GET /health` before its first request (vLLM's
    server answers it, and `/ping`, `/version`, without a key); an edge that can take
    requests answers 200 with an empty body (503 while draining: test_edge_drain_stack)."""
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        answer = httpx.request(method, f"{api.http_url}{path}")
        assert (answer.status_code, answer.content) == (200, b""), (method, path)
    assert httpx.get(f"{api.http_url}/version").json() == {"version": version("tokenbus")}


def test_models_retrieve_gives_one_card_or_a_json_404(api: Stack) -> None:
    card = openai_sdk(api).models.retrieve(SLOW_MODEL)
    assert (card.id, card.object, card.owned_by) == (SLOW_MODEL, "model", "tokenbus")
    assert (card.model_extra or {}).get("max_model_len") == SLOW_LEN
    listed = {m.id: m for m in openai_sdk(api).models.list()}
    assert card == listed[SLOW_MODEL]
    with openai_sdk(api) as client:  # closed here: see test_504_...
        for unknown in ("gpt-4o", "HuggingFaceTB/SmolLM2-135M-Instruct"):  # `/` sent as %2F
            with pytest.raises(openai.NotFoundError) as caught:
                client.models.retrieve(unknown)
            check_error(caught.value, 404, "model_not_found")
            assert caught.value.response.headers["content-type"] == "application/json"
            assert unknown in caught.value.message
            assert MODEL in caught.value.message
    with (
        openai.OpenAI(base_url=f"{api.http_url}/v1", api_key="sk-nope") as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.models.retrieve(MODEL)


def test_explicit_nulls_are_read_as_unset(api: Stack) -> None:
    """What clients that serialise unset fields send (vLLM's server takes it)."""
    nulls = {"n": None, "stream": None, "temperature": None, "stop": None, "user": None}
    chat = post(
        api,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt(), "name": None}],
            "max_tokens": 4,
            "stream_options": None,
            "max_completion_tokens": None,
            **nulls,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion"  # `stream: null` is not streaming
    text = post(
        api,
        "/v1/completions",
        {"model": MODEL, "prompt": prompt(), "max_tokens": 4, "echo": None, **nulls},
    )
    assert text.status_code == 200, text.text
    assert text.json()["choices"][0]["text"]
    streamed = post(
        api,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt()}],
            "max_tokens": 4,
            "stream": True,
            "n": None,
            "stream_options": {"include_usage": None, "continuous_usage_stats": None},
        },
    )
    assert streamed.status_code == 200, streamed.text
    assert streamed.text.endswith("data: [DONE]\n\n")


def post(stack: Stack, path: str, body: object, tenant: str = "default") -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.keys[tenant]}"}
    return httpx.post(f"{stack.http_url}{path}", json=body, headers=headers, timeout=60)


async def test_chat_sync_and_async_equal_the_websocket_answer(api: Stack) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": prompt()},
    ]
    expected = await ws_answer(api, {"messages": messages, "max_tokens": 24})
    whole = openai_sdk(api).chat.completions.create(model=MODEL, messages=messages, max_tokens=24)  # type: ignore[arg-type]
    assert whole.object == "chat.completion"
    assert whole.model == MODEL
    raw = openai_sdk(api).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
    )
    assert raw.parse().id == f"chatcmpl-{raw.headers['X-Request-Id']}"
    assert whole.choices[0].message.content == expected["text"]
    assert whole.choices[0].finish_reason == expected["finish"]
    check_usage(whole.usage, expected["usage"])

    async with async_sdk(api) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == expected["finish"]
    assert all(f is None for f in finishes[:-1])
    *_, last = chunks
    assert last.choices == []
    check_usage(last.usage, expected["usage"])
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-")


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_continuous_usage_stats_count_up_to_the_finals_usage(api: Stack, kind: str) -> None:
    """Issue 42 item 4: guidellm streams with vLLM's `continuous_usage_stats`, which was
    refused 400. Every chunk carries the usage so far (the role chunk the prompt's, the
    finish chunk every token), from the counts the worker's deltas carry."""
    client = openai_sdk(api)
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    asked: dict[str, Any] = {"model": MODEL, "max_tokens": 30, "stream": True}
    if kind == "chat":
        asked["messages"] = [{"role": "user", "content": prompt()}]
        chunks: list[Any] = list(client.chat.completions.create(**asked, stream_options=options))
    else:
        asked["prompt"] = prompt()
        chunks = list(client.completions.create(**asked, stream_options=options))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages), usages
    final = usages[-1]
    assert final.completion_tokens > 1
    completions = [u.completion_tokens for u in usages]
    assert completions == sorted(completions)  # never back
    assert completions[-2] == final.completion_tokens  # the finish chunk counts them all
    assert {u.prompt_tokens for u in usages} == {final.prompt_tokens}
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)


async def test_completions_sync_stream_and_async_equal_the_websocket_answer(api: Stack) -> None:
    text = prompt()
    expected = await ws_answer(
        api, {"prompt": text, "max_tokens": 16, "temperature": 0.5, "stop": ["zzz"], "seed": 7}
    )
    params: dict[str, Any] = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": 16,
        "temperature": 0.5,
        "stop": "zzz",
        "seed": 7,
    }
    async with async_sdk(api) as client:
        whole = await client.completions.create(**params)
    assert whole.object == "text_completion"
    assert whole.choices[0].text == expected["text"]
    check_usage(whole.usage, expected["usage"])
    streamed = openai_sdk(api).completions.create(**params, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected["text"]


async def test_priority_and_deadline_extensions_are_carried_to_kafka(api: Stack) -> None:
    text = prompt()
    openai_sdk(api).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=4,
        extra_body={"priority": 5, "deadline_ms": 60000},
    )
    records = [json.loads(v) for v in await api.read_requests()]
    (record,) = [r for r in records if r["messages"] and r["messages"][0]["content"] == text]
    assert (record["priority"], record["deadline_ms"]) == ("background", 60000)
    assert record["max_tokens"] == 4


async def test_a_callers_traceparent_is_continued_on_kafka(api: Stack) -> None:
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    text = prompt()
    async with async_sdk(api) as client:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": text}],
            max_tokens=2,
            extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        )
    records = [r for t in api.request_topics for r in await read_with_headers(api, t)]
    (headers,) = [h for value, h in records if text.encode() in value]
    assert headers["traceparent"].split("-")[1] == trace_id


async def read_with_headers(stack: Stack, topic: str) -> list[tuple[bytes, dict[str, str]]]:
    """Every record of one of the stack's topics now: its value and headers."""
    consumer = make_consumer(stack.settings, group_id=None, client_id="openai-test")
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(stack.topics.partitions()[topic])]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        out: list[tuple[bytes, dict[str, str]]] = []
        todo = {tp for tp in parts if ends[tp] > 0}
        while todo:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                out += [(r.value or b"", {k: v.decode() for k, v in r.headers}) for r in batch]
            todo = {tp for tp in todo if await consumer.position(tp) < ends[tp]}
        return out
    finally:
        await consumer.stop()


# -- errors -------------------------------------------------------------------------------------


def check_error(exc: openai.APIStatusError, status: int, code: str) -> None:
    assert exc.status_code == status
    body = exc.body
    assert isinstance(body, dict), body
    assert body["code"] == code, body
    assert body["message"]
    assert REQUEST_ID.match(exc.response.headers.get("X-Request-Id", "")), exc.response.headers


def check_retry_hint(headers: httpx.Headers) -> None:
    """The exact hint under the name the `openai` SDK reads, and tokenbus's; whole seconds,
    rounded up, in `Retry-After`."""
    ms = int(headers["retry-after-ms"])
    assert ms > 0
    assert int(headers["X-Tokenbus-Retry-After-Ms"]) == ms
    assert int(headers["Retry-After"]) == max(1, math.ceil(ms / 1000))


def test_every_error_carries_a_request_id_of_its_own(api: Stack) -> None:
    auth = {"Authorization": f"Bearer {api.keys['default']}"}
    answers = [
        httpx.post(f"{api.http_url}/v1/chat/completions", content=b"{", headers=auth),
        post(api, "/v1/chat/completions", {"messages": [], "n": "x"}),  # validation
        post(api, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}),
        httpx.get(f"{api.http_url}/v1/models"),  # no key
        httpx.get(f"{api.http_url}/v1/models/nope", headers=auth),
        post(api, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user"}]}),
    ]
    assert [a.status_code for a in answers] == [400, 400, 400, 401, 404, 404]
    ids = [a.headers.get("X-Request-Id", "") for a in answers]
    assert all(REQUEST_ID.match(i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    assert all("error" in a.json() for a in answers)


def test_400_for_n_above_one_and_bad_fields(api: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_sdk(api).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2
        )
    check_error(caught.value, 400, "invalid_request")
    assert "only n=1" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        openai_sdk(api).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6
        )
    assert "max_tokens" in caught.value.message


def test_401_for_a_missing_or_unknown_key(api: Stack) -> None:
    bad = openai.OpenAI(base_url=f"{api.http_url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    check_error(caught.value, 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{api.http_url}/v1/models").status_code == 401


def test_404_for_a_model_no_worker_serves(api: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        openai_sdk(api).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    check_error(caught.value, 404, "model_not_found")
    assert MODEL in caught.value.message


def test_429_with_retry_after_past_the_tenant_quota(api: Stack) -> None:
    client = openai_sdk(api, "slow")
    for _ in range(2):  # the burst
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    check_error(caught.value, 429, "rate_limit_exceeded")
    check_retry_hint(caught.value.response.headers)
    # Streaming too: refused before the stream starts, so a status, not a 200 stream.
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True)
    check_error(caught.value, 429, "rate_limit_exceeded")
    check_retry_hint(caught.value.response.headers)


def test_400_not_429_for_a_request_no_wait_could_admit(api: Stack) -> None:
    """Issue 37's regression: max_tokens 1,000,000,000 from a tenant with a tokens/min
    limit was answered 429 ("it can never be admitted"), which the `openai` SDK retries by
    default. A request that can never succeed is a 400 naming the field, as vLLM's is; so
    is one that fits the model but not the tenant's whole minute."""
    with openai_sdk(api, "metered") as client:
        for max_tokens, says in ((10**9, "max_tokens"), (MODEL_LEN - 100, "tokens_per_min")):
            with pytest.raises(openai.BadRequestError) as caught:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=max_tokens)
            check_error(caught.value, 400, "invalid_request")
            assert says in caught.value.body["message"], caught.value.body  # type: ignore[index]
            assert "retry-after-ms" not in caught.value.response.headers
        # The refusals charged nothing: a request within the minute is served at once.
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_504_when_the_deadline_passes_in_the_queue(api: Stack) -> None:
    # Closed here: a client left to the garbage collector in an exception's cycle can warn
    # of its pooled socket during a later test.
    with openai_sdk(api) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt()}],
                extra_body={"deadline_ms": 1},
            )
        check_error(caught.value, 504, "deadline_exceeded")
        # A stream was accepted, so its 200 went out at once: the failure is an error event.
        with client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt()}],
            stream=True,
            extra_body={"deadline_ms": 1},
        ) as stream:
            assert stream.response.status_code == 200
            with pytest.raises(openai.APIError) as raised:
                list(stream)
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["code"] == "deadline_exceeded"


def test_503_with_retry_after_when_kafka_does_not_take_the_request(api: Stack) -> None:
    # An edge whose writes to Kafka time out at once: the overloaded path of an outage.
    port = free_port()
    api.start_service(
        "edge",
        key="edge-timeout",
        TOKENBUS_EDGE_PORT=str(port),
        TOKENBUS_EDGE_PRODUCE_TIMEOUT_S="0.000001",
        # Nor waited for past that while the broker answers (ADR 0049).
        TOKENBUS_EDGE_PRODUCE_WAIT_S="0.000001",
    )
    try:
        wait_until(lambda: api.edge_ready(port), 60, "the second edge's /healthz")
        with pytest.raises(openai.APIStatusError) as caught:
            openai_sdk(api, port=port).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        check_error(caught.value, 503, "overloaded")
        with pytest.raises(openai.APIStatusError) as caught:
            openai_sdk(api, port=port).completions.create(model=MODEL, prompt="hi", stream=True)
        check_error(caught.value, 503, "overloaded")
        check_retry_hint(caught.value.response.headers)
    finally:
        api.stop_service("edge-timeout")


# -- streams: headers at once, keep-alives, resume and disconnect -------------------------------


def test_a_stream_sends_its_headers_and_keep_alives_before_a_slow_first_token(
    api: Stack,
) -> None:
    """A proxy with a read timeout sees bytes while the first token is on its way."""
    body = {
        "model": SLOW_MODEL,
        "messages": [{"role": "user", "content": prompt()}],
        "max_tokens": 2,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {api.keys['default']}"}
    started = time.monotonic()
    lines: list[tuple[str, float]] = []
    with httpx.stream(
        "POST", f"{api.http_url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as response:
        headers_at = time.monotonic() - started
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert REQUEST_ID.match(response.headers["X-Request-Id"])
        lines += [(line, time.monotonic() - started) for line in response.iter_lines()]
    first_data = next(at for line, at in lines if line.startswith("data: "))
    keepalives = [at for line, at in lines if line == ": keep-alive"]
    # The first token takes 1 / SLOW_RATE s (2.5 s): the headers did not wait for it...
    assert first_data - headers_at > 1.0, (headers_at, lines)
    # ...and comments kept the connection busy meanwhile.
    assert keepalives, lines
    assert keepalives[0] < first_data, lines
    assert keepalives[0] - headers_at < KEEPALIVE_S + 1.0, (headers_at, lines)
    assert [line for line, _ in lines if line][-1] == "data: [DONE]"


def sse_events(response: httpx.Response, count: int) -> list[tuple[str, dict[str, Any]]]:
    """The first `count` events of a raw SSE response: (id, data)."""
    out: list[tuple[str, dict[str, Any]]] = []
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if line:
            name, _, value = line.partition(": ")
            fields[name] = value
            continue
        if "data" in fields:
            out.append((fields.get("id", ""), json.loads(fields["data"])))
            if len(out) == count:
                return out
        fields = {}
    raise AssertionError(f"the stream ended after {len(out)} events")


def test_a_stream_is_data_lines_only_unless_event_ids_are_asked_for(api: Stack) -> None:
    """As OpenAI's and vLLM's servers send it: each event one `data:` line, which is how
    `vllm bench serve` reads a stream (an `id:` line first failed every request there)."""
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 8, "stream": True}
    auth = {"Authorization": f"Bearer {api.keys['default']}"}

    def messages(headers: dict[str, str]) -> list[str]:
        with httpx.stream(
            "POST", f"{api.http_url}/v1/completions", json=body, headers=headers, timeout=60
        ) as response:
            assert response.status_code == 200
            raw = "".join(response.iter_text())
        return [m.strip() for m in raw.split("\n\n") if m.strip() and not m.startswith(":")]

    plain = messages(auth)
    assert plain[-1] == "data: [DONE]"
    for message in plain[:-1]:  # what vLLM's benchmark client does with each
        assert message.startswith("data: ")
        assert json.loads(message.removeprefix("data: "))["object"] == "text_completion"
    with_ids = messages({**auth, "X-Tokenbus-Event-Ids": "1"})
    assert all(m.startswith("id: ") for m in with_ids[:-1])


def test_a_dropped_stream_resumes_after_last_event_id_without_a_gap(api: Stack) -> None:
    text = long_prompt()
    messages = [{"role": "user", "content": text}]
    # The WebSocket's answer, meanwhile (each takes 10+ s at the stack's token rate).
    with ThreadPoolExecutor(1) as pool:
        expected = pool.submit(
            asyncio.run, ws_answer(api, {"messages": messages, "max_tokens": 200})
        )
        before, after, ids, token = drop_and_resume(api, messages)
        assert before + after == expected.result(timeout=120)["text"]
    assert after
    # Another tenant's key cannot resume it.
    with pytest.raises(openai.AuthenticationError):
        openai_sdk(api, "alice").chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            stream=True,
            extra_headers={"Last-Event-ID": ids[-1], "X-Tokenbus-Resume-Token": token},
        )


def drop_and_resume(api: Stack, messages: list[dict[str, str]]) -> tuple[str, str, list[str], str]:
    """Read a stream's first events over raw SSE, drop it, resume with the SDK: the text
    before, the text after, the ids seen, and the resume token."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True}
    headers = {"Authorization": f"Bearer {api.keys['default']}", "X-Tokenbus-Event-Ids": "1"}
    with httpx.stream(
        "POST", f"{api.http_url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        token = response.headers["X-Tokenbus-Resume-Token"]
        events = sse_events(response, 4)  # the role chunk, then three deltas
    ids = [i for i, _ in events]
    assert ids == ["0:-1", "0:0", "0:1", "0:2"]
    before = "".join(d["choices"][0]["delta"]["content"] for _, d in events)
    # The client is gone; it comes back within the grace, with the SDK.
    rest = openai_sdk(api).chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=200,
        stream=True,
        extra_headers={"Last-Event-ID": ids[-1], "X-Tokenbus-Resume-Token": token},
    )
    after = "".join(c.choices[0].delta.content or "" for c in rest)
    return before, after, ids, token


def test_a_client_that_goes_away_is_cancelled_after_the_grace(api: Stack) -> None:
    messages = [{"role": "user", "content": long_prompt()}]
    with openai_sdk(api).chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=200,
        stream=True,
    ) as stream:
        request_id = stream.response.headers["X-Request-Id"]
        next(iter(stream))
    left_at = time.time()

    def cancels() -> list[CancelRecord]:
        values = api.read(api.topics.control)
        records = [json.loads(v) for v in values]
        return [
            CancelRecord.model_validate(r)
            for r in records
            if r.get("kind") == "cancel" and r.get("request_id") == request_id
        ]

    wait_until(lambda: cancels(), 60, "the disconnect cancel", interval=0.5)
    (cancel,) = cancels()
    assert cancel.reason == "disconnect"
    assert cancel.sent_at >= left_at + GRACE_S - 0.5  # not before the grace ran out
    # The worker stopped: the stream ended as cancelled, not run to its end.
    results = [json.loads(v) for v in api.read(api.topics.results)]
    (final,) = [r for r in results if r["request_id"] == request_id and r["kind"] != "delta"]
    assert final.get("finish_reason") == "cancelled" or final.get("code") == "cancelled", final
