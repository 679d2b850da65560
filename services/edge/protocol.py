"""The `/v1/chat` WebSocket protocol: client frames in, server frames out."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, ValidationError

from shared.messages import (
    REQUEST_ID,
    ChatRequest,
    ErrorCode,
    Model,
    RequestLimits,
    Tier,
    Timings,
    TokenLogprob,
    ToolCall,
    Usage,
    error_message,
)


class AuthFrame(Model):
    type: Literal["auth"]
    api_key: str = Field(min_length=1, max_length=512)


class ChatRequestFrame(ChatRequest):
    type: Literal["chat.request"]

    def request(self) -> ChatRequest:
        request = ChatRequest.model_validate(self.model_dump(exclude={"type"}))
        request.carry_estimate(self)  # validated under the edge's limits
        return request


class ChatCancelFrame(Model):
    type: Literal["chat.cancel"]
    request_id: str = Field(pattern=REQUEST_ID)


class StreamResumeFrame(Model):
    type: Literal["stream.resume"]
    resume_token: str = Field(min_length=1, max_length=4096)
    after_seq: int = Field(default=-1, ge=-1)
    # `seq` restarts with every attempt, so after_seq counts in the attempt of the last
    # `chat.reset` the client saw (0 if none).
    attempt: int = Field(default=0, ge=0)


ClientFrame = Annotated[
    AuthFrame | ChatRequestFrame | ChatCancelFrame | StreamResumeFrame,
    Field(discriminator="type"),
]
_client_frames: TypeAdapter[ClientFrame] = TypeAdapter(ClientFrame)


class ProtocolError(Exception):
    """A frame the edge cannot act on; becomes an `error` frame, the socket stays open."""

    def __init__(self, message: str, client_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.client_id = client_id


def parse_client_frame(data: str | bytes, limits: RequestLimits, max_bytes: int) -> ClientFrame:
    size = len(data.encode() if isinstance(data, str) else data)
    if size > max_bytes:
        raise ProtocolError(f"frame: {size} bytes, above the limit of {max_bytes} bytes")
    try:
        return _client_frames.validate_json(data, context={"limits": limits})
    except ValidationError as exc:
        errors = exc.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            raise ProtocolError("frame: not valid JSON") from None
        if any(not e["loc"] and not e["type"].startswith("union_tag") for e in errors):
            raise ProtocolError("frame: must be a JSON object with a type") from None
        raise ProtocolError(error_message(exc, skip_loc=1), _client_id(data)) from None


def _client_id(data: str | bytes) -> str | None:
    import json

    try:
        body = json.loads(data)
    except ValueError:
        return None
    value = body.get("client_id") if isinstance(body, dict) else None
    return value if isinstance(value, str) and len(value) <= 128 else None


class AcceptedFrame(Model):
    type: Literal["chat.accepted"] = "chat.accepted"
    request_id: str
    client_id: str | None = None
    resume_token: str
    tier: Tier


class DeltaFrame(Model):
    type: Literal["chat.delta"] = "chat.delta"
    request_id: str
    seq: int
    text: str
    # One per generated token of `text`, when the request asked for `logprobs`; absent
    # from the frame otherwise.
    logprobs: list[TokenLogprob] | None = Field(default=None, exclude_if=lambda v: v is None)
    # The tokens `text` covers and, on the stream's first engine output, the prompt's: for
    # the OpenAI API's `continuous_usage_stats`; never sent over the WebSocket.
    tokens: int | None = Field(default=None, exclude=True)
    prompt_tokens: int | None = Field(default=None, exclude=True)


class ResetFrame(Model):
    type: Literal["chat.reset"] = "chat.reset"
    request_id: str
    attempt: int


class StreamResumedFrame(Model):
    """A resume was accepted: the deltas after `after_seq` of `attempt` follow, then the rest."""

    type: Literal["stream.resumed"] = "stream.resumed"
    request_id: str
    attempt: int
    after_seq: int


class DoneFrame(Model):
    type: Literal["chat.done"] = "chat.done"
    request_id: str
    finish_reason: str
    usage: Usage
    timings: Timings
    model: str | None = None  # the model that answered (its fallback, if it ran there)
    cached: bool = False  # answered from the response cache, not by a worker
    # The tools the answer calls (the deltas carried its text as generated), and its text
    # besides the calls; absent from the frame when it calls none.
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    # The variant of `model` that answered (ADR 0054); absent: the model's baseline.
    variant: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ErrorFrame(Model):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    request_id: str | None = None
    client_id: str | None = None
    # `rate_limited` and `overloaded`: when trying again may succeed; None: no hint.
    retry_after_ms: int | None = None


ServerFrame = AcceptedFrame | DeltaFrame | ResetFrame | DoneFrame | ErrorFrame | StreamResumedFrame
