"""Builders of what the tests feed the code under test: requests as clients send them."""

from __future__ import annotations

from aiokafka import ConsumerRecord

from services.edge.openai.errors import HttpError
from services.edge.openai.schema import ChatCompletionRequest, CompletionRequest
from services.edge.openai.translate import to_chat_request
from services.worker.engines.sim_text import complete
from shared.messages import ChatRequest, QueuedRequest, ReplyTo, RequestLimits, Tier

# The edge's limits for the OpenAI request builders below.
OPENAI_LIMITS = RequestLimits(max_tokens_cap=100, default_max_tokens=16)


def openai_chat(**fields: object) -> ChatRequest | HttpError:
    """A `/v1/chat/completions` body (model `m`, one user turn `hi`, then `fields`) as the
    edge translates it."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return to_chat_request(ChatCompletionRequest.model_validate(body), OPENAI_LIMITS)


def openai_completion(**fields: object) -> ChatRequest | HttpError:
    """A `/v1/completions` body (model `m`, prompt `once upon`, then `fields`) as the edge
    translates it."""
    body = {"model": "m", "prompt": "once upon", **fields}
    return to_chat_request(CompletionRequest.model_validate(body), OPENAI_LIMITS)


def translated(result: ChatRequest | HttpError) -> ChatRequest:
    """The request a translation made; fails the test, showing the error, if it was refused."""
    assert isinstance(result, ChatRequest), result
    return result


def queued_request(request_id: str = "r1", **fields: object) -> QueuedRequest:
    """A request as a tier topic holds it: prompt `hi` (one token), interactive, answered on
    `t.results` partition 0, created at 100.0 (seconds); `fields` change any of it."""
    base: dict[str, object] = {
        "request_id": request_id,
        "prompt": "hi",
        "tier": Tier.interactive,
        "prompt_tokens": 1,
        "reply_to": ReplyTo(topic="t.results", partition=0),
        "created_at": 100.0,
    }
    return QueuedRequest.model_validate({**base, **fields})


def consumer_record(
    topic: str,
    value: bytes,
    *,
    partition: int = 0,
    offset: int = 0,
    key: bytes | None = None,
    headers: tuple[tuple[str, bytes], ...] = (),
) -> ConsumerRecord[bytes, bytes]:
    """A record as aiokafka's consumer hands it over (no timestamp, no checksum)."""
    return ConsumerRecord(
        topic=topic,
        partition=partition,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=len(key) if key is not None else 0,
        serialized_value_size=len(value),
        headers=headers,
    )


def long_prompts(count: int, min_tokens: int, tag: str) -> list[str]:
    """`count` prompts (`{tag} {i}`) whose answers from the sim engine run at least
    `min_tokens` tokens."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        prompt = f"{tag} {i}"
        if complete(prompt, 500).completion_tokens >= min_tokens:
            found.append(prompt)
        i += 1
    return found
