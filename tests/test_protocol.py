"""Parsing client frames: typed results for good frames, field-naming errors for bad ones."""

from __future__ import annotations

import json

import pytest

from services.edge.protocol import (
    AuthFrame,
    ChatCancelFrame,
    ChatRequestFrame,
    ProtocolError,
    StreamResumeFrame,
    parse_client_frame,
)
from shared.messages import RequestLimits

LIMITS = RequestLimits(max_tokens_cap=100, default_max_tokens=10, max_prompt_chars=50)


def parse(frame: object) -> object:
    return parse_client_frame(json.dumps(frame), LIMITS, max_bytes=4096)


def test_chat_request_gets_its_output_estimate_from_the_limits() -> None:
    frame = parse({"type": "chat.request", "prompt": "hi", "stop": "\n"})
    assert isinstance(frame, ChatRequestFrame)
    assert frame.max_tokens is None  # unset: the rest of the context (ADR 0051)
    assert frame.effective_max_tokens == frame.request().effective_max_tokens == 10
    assert frame.stop == ["\n"]
    assert frame.request().prompt_text() == "hi"


def test_messages_render_as_role_lines() -> None:
    frame = parse(
        {
            "type": "chat.request",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ],
        }
    )
    assert isinstance(frame, ChatRequestFrame)
    assert frame.prompt_text() == "system: be brief\nuser: hi"


@pytest.mark.parametrize(
    ("frame", "kind"),
    [
        ({"type": "auth", "api_key": "k"}, AuthFrame),
        ({"type": "chat.cancel", "request_id": "abc"}, ChatCancelFrame),
        ({"type": "stream.resume", "resume_token": "t", "after_seq": 3}, StreamResumeFrame),
    ],
)
def test_other_frame_types(frame: dict[str, object], kind: type) -> None:
    assert isinstance(parse(frame), kind)


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        ({"type": "chat.request", "prompt": "hi", "max_tokens": 101}, "max_tokens"),
        ({"type": "chat.request", "prompt": "x" * 51}, "prompt"),
        ({"type": "chat.request", "messages": [{"role": "user", "content": "x" * 60}]}, "messages"),
        ({"type": "chat.request", "prompt": "hi", "top_p": 0}, "top_p"),
        ({"type": "chat.request", "prompt": "hi", "priority": "urgent"}, "priority"),
        ({"type": "chat.request", "prompt": "hi", "deadline_ms": 0}, "deadline_ms"),
        ({"type": "chat.request", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"type": "chat.cancel", "request_id": "has spaces"}, "request_id"),
        ({"type": "stream.resume", "resume_token": "t", "after_seq": -2}, "after_seq"),
        ({"type": "other"}, "type"),
    ],
)
def test_bad_frames_name_the_field(frame: dict[str, object], field: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse(frame)
    assert field in caught.value.message


def test_oversized_frame_is_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="frame: 5000 bytes"):
        parse_client_frame("x" * 5000, LIMITS, max_bytes=4096)


def test_client_id_survives_a_rejection() -> None:
    with pytest.raises(ProtocolError) as caught:
        parse({"type": "chat.request", "client_id": "mine", "prompt": "hi", "max_tokens": 0})
    assert caught.value.client_id == "mine"
