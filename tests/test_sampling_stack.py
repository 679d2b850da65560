"""vLLM's sampling fields on a real stack (a real broker, the sim engine), as clients send them.

The `openai` SDK sends vLLM's extensions in `extra_body`: what the sim engine honours runs
(`seed`, `ignore_eos`), what it does not is a 400 naming the field and the engine; the
WebSocket refuses it the same way; a record that reaches the worker past the edge (written
to the requests topic by any Kafka client) is answered `invalid_request`, never run as if
the field were not there.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import openai
import pytest
import websockets

from shared.kafka import create_topics, make_consumer, make_producer
from tests.chat_client import openai_sdk, served_models
from tests.stack import Stack, wait_until

MODEL = "sim-8b"  # the worker's default `worker_model`


@pytest.fixture(scope="module")
def api(stack: Stack) -> Stack:
    """The session's default stack (tests/conftest.py), once its worker serves the model."""
    wait_until(lambda: served_models(stack) == [MODEL], 30, "the model")
    return stack


def ask(stack: Stack, **extra: object) -> openai.types.chat.ChatCompletion:
    return openai_sdk(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"tell me about buses {uuid.uuid4().hex}"}],
        max_tokens=40,
        **extra,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    "extra",
    [
        {"extra_body": {"top_k": 5}},
        {"extra_body": {"min_p": 0.05}},
        {"extra_body": {"repetition_penalty": 1.1}},
        {"extra_body": {"stop_token_ids": [2]}},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"logit_bias": {"11": 5}},
    ],
)
def test_a_field_the_sim_does_not_honour_is_a_400_naming_it_and_the_engine(
    api: Stack, extra: dict[str, object]
) -> None:
    (field,) = extra.get("extra_body", extra)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as caught:
        ask(api, **extra)
    assert caught.value.status_code == 400
    message = caught.value.message
    assert f"{field}: not supported by the engine serving model '{MODEL}' (sim)" in message


@pytest.mark.parametrize("extra", [{"logprobs": True}, {"logprobs": True, "top_logprobs": 2}])
def test_logprobs_on_the_sim_are_a_400_naming_the_field_and_the_engine(
    api: Stack, extra: dict[str, object]
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(api, **extra)
    assert caught.value.status_code == 400
    assert f"logprobs: not supported by the engine serving model '{MODEL}' (sim)" in (
        caught.value.message
    )


def test_completion_logprobs_on_the_sim_are_a_400_too(api: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_sdk(api).completions.create(model=MODEL, prompt="once", max_tokens=4, logprobs=2)
    assert "logprobs: not supported by the engine" in caught.value.message
    assert "(sim)" in caught.value.message


def test_neutral_values_are_accepted(api: Stack) -> None:
    answer = ask(api, presence_penalty=0, extra_body={"top_k": -1, "repetition_penalty": 1})
    assert answer.choices[0].message.content


def test_seed_picks_a_sample_and_ignore_eos_runs_to_max_tokens(api: Stack) -> None:
    messages = [{"role": "user", "content": f"seeded {uuid.uuid4().hex}"}]
    client = openai_sdk(api)

    def text(seed: int, **extra: object) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=200,
            seed=seed,
            extra_body={"cache": False, **extra},
        )

    one, again, other = text(1), text(1), text(2)
    assert one.choices[0].message.content == again.choices[0].message.content
    assert one.choices[0].message.content != other.choices[0].message.content
    assert one.choices[0].finish_reason == "stop"  # the sim's natural end, under 200 tokens
    to_the_end = text(1, ignore_eos=True, min_tokens=10)
    assert to_the_end.choices[0].finish_reason == "length"
    assert to_the_end.usage is not None
    assert to_the_end.usage.completion_tokens == 200


async def test_the_websocket_refuses_it_as_an_invalid_request(api: Stack) -> None:
    async with websockets.connect(api.ws_url) as ws:
        request = {"type": "chat.request", "client_id": "c1", "prompt": "hi", "top_k": 5}
        await ws.send(json.dumps(request))
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if frame["type"] == "error":
                break
            assert frame["type"] not in ("chat.accepted", "chat.delta"), frame
    assert frame["code"] == "invalid_request"
    assert frame["client_id"] == "c1"
    assert frame["message"].startswith("top_k: not supported by the engine serving this deployment")
    assert "(sim)" in frame["message"]


@pytest.mark.parametrize(("field", "value"), [("top_k", 5), ("logprobs", 0)])
async def test_a_worker_answers_a_field_its_engine_does_not_honour_invalid_request(
    api: Stack, field: str, value: object
) -> None:
    reply_topic = f"{api.prefix}.sampling-replies-{field}"
    await create_topics(api.settings, {reply_topic: 1})
    request_id = "direct-" + uuid.uuid4().hex[:8]
    record = {
        "request_id": request_id,
        "prompt": "past the edge",
        "max_tokens": 12,
        field: value,
        "reply_to": {"topic": reply_topic},
    }
    producer = make_producer(api.settings, "sampling-test")
    await producer.start()
    try:
        await producer.send_and_wait(
            api.topics.requests, json.dumps(record).encode(), key=request_id.encode()
        )
    finally:
        await producer.stop()
    consumer = make_consumer(api.settings, reply_topic, group_id=None, client_id="sampling-test")
    await consumer.start()
    results: list[dict[str, object]] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            r["kind"] in ("done", "error") for r in results
        ):
            batches = await consumer.getmany(timeout_ms=500)
            results += [json.loads(m.value) for ms in batches.values() for m in ms if m.value]
    finally:
        await consumer.stop()
    assert [r["kind"] for r in results] == ["error"], results
    (error,) = results
    assert error["code"] == "invalid_request"
    assert str(error["message"]).startswith(f"{field}: not supported by the engine")
    assert "(sim)" in str(error["message"])
