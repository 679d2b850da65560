"""max_tokens as vLLM has it, on a real stack (a real broker, the sim engine; ADR 0051).

A client that sends no max_tokens (OpenWebUI, LangChain) gets the whole answer, not its
first 256 tokens: the answer ends at its own end ("stop") or at the end of the context
("length"). A max_tokens above the model's context is a 400 (WebSocket: invalid_request)
naming it and the context, once the edge knows the context from the workers' heartbeats.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import websockets

from tests.chat_client import openai_sdk
from tests.stack import Stack, new_prefix, wait_until

MODEL = "sim-8b"  # the worker's default `worker_model`
CONTEXT = 1024  # the worker's TOKENBUS_WORKER_MAX_MODEL_LEN
OLD_DEFAULT = 256  # what an unset max_tokens was cut at before


@pytest.fixture(scope="module")
def api(bootstrap: str, log_dir: Path) -> Iterator[Stack]:
    stack = Stack(
        bootstrap=bootstrap,
        prefix=new_prefix(),
        log_dir=log_dir,
        env_overrides={"TOKENBUS_WORKER_SIM_TOKEN_RATE": "2000"},
        workers={"worker": {"TOKENBUS_WORKER_MAX_MODEL_LEN": str(CONTEXT)}},
    )
    try:
        stack.start()
        # The edge knows the model's context once it has read the worker's heartbeats.
        wait_until(lambda: context_of(stack) == CONTEXT, 30, "the model's context on its card")
        yield stack
    finally:
        stack.stop()


def context_of(stack: Stack) -> int | None:
    cards = openai_sdk(stack).models.list().data
    if [c.id for c in cards] != [MODEL]:
        return None
    length = (cards[0].model_extra or {}).get("max_model_len")
    return length if isinstance(length, int) else None


def ask(stack: Stack, **extra: object) -> openai.types.chat.ChatCompletion:
    """A chat that names no max_tokens, as LangChain's ChatOpenAI sends it by default."""
    return openai_sdk(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"write a long story {uuid.uuid4().hex}"}],
        **extra,  # type: ignore[arg-type]
    )


def test_an_answer_longer_than_256_tokens_comes_whole_without_max_tokens(api: Stack) -> None:
    # The sim's answer goes on to 300 tokens (min_tokens), then ends on its own.
    answer = ask(api, extra_body={"min_tokens": 300})
    assert answer.usage is not None
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens >= 300 > OLD_DEFAULT


def test_an_answer_without_an_end_runs_to_the_end_of_the_context(api: Stack) -> None:
    answer = ask(api, extra_body={"ignore_eos": True})
    assert answer.usage is not None
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == CONTEXT
    assert answer.usage.completion_tokens > OLD_DEFAULT


def test_max_tokens_above_the_context_is_a_400_naming_it(api: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(api, max_tokens=CONTEXT + 1)
    assert caught.value.status_code == 400
    message = caught.value.message
    assert f"max_tokens: This model's maximum context length is {CONTEXT} tokens" in message
    assert f"you requested {CONTEXT + 1} output tokens" in message
    # The old cap of 4096 is gone: a max_tokens the context holds runs.
    answer = ask(api, max_tokens=CONTEXT)
    assert answer.choices[0].finish_reason == "stop"


async def test_the_websocket_has_the_same_rules(api: Stack) -> None:
    async with websockets.connect(api.ws_url) as ws:
        over = {"type": "chat.request", "client_id": "over", "prompt": "hi"}
        await ws.send(json.dumps({**over, "max_tokens": CONTEXT + 1}))
        frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert frame["type"] == "error", frame
        assert frame["code"] == "invalid_request"
        assert frame["client_id"] == "over"
        assert frame["message"].startswith("max_tokens: This model's maximum context length")
        unset = {"type": "chat.request", "client_id": "long", "prompt": "a long one"}
        await ws.send(json.dumps({**unset, "min_tokens": 300}))
        while (frame := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in (
            "chat.done",
            "error",
        ):
            pass
    assert frame["type"] == "chat.done", frame
    assert frame["finish_reason"] == "stop"
    assert frame["usage"]["completion_tokens"] >= 300 > OLD_DEFAULT
