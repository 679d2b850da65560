"""Server-sent events: event framing, `id: <attempt>:<seq>`, and reading `Last-Event-ID`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"
# Sent while a stream waits for its first token, so proxies keep the connection open.
KEEPALIVE = b": keep-alive\n\n"
_EVENT_ID = re.compile(r"^(\d{1,9}):(-1|\d{1,9})$")


@dataclass(frozen=True)
class EventId:
    """Where an event stands in a request's stream: the attempt and the delta `seq` in it.

    `seq` -1: no delta of the attempt yet (the role chunk that opens a stream).
    """

    attempt: int
    seq: int

    def __str__(self) -> str:
        return f"{self.attempt}:{self.seq}"


def parse_event_id(value: str) -> EventId | None:
    """A `Last-Event-ID` header as an EventId; None if it is not one of ours."""
    match = _EVENT_ID.match(value.strip())
    if match is None:
        return None
    return EventId(int(match[1]), int(match[2]))


def event(body: BaseModel, event_id: EventId | None = None) -> bytes:
    """One SSE event carrying `body` as JSON; `id:` first, so a reader knows where it is."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {body.model_dump_json(exclude_none=False)}\n\n".encode()
