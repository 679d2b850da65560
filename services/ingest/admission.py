"""Validates a raw request record and decides where it goes: a tier topic, or the DLQ."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from pydantic import ValidationError

from shared.messages import (
    ErrorCode,
    ErrorResult,
    QueuedRequest,
    ReplyTo,
    RequestLimits,
    RequestRecord,
    Tier,
    error_message,
)
from shared.topics import Topics


@dataclass(frozen=True)
class Admitted:
    request: QueuedRequest
    topic: str


@dataclass(frozen=True)
class Rejected:
    """An invalid record: it goes to the DLQ, and its error to `reply_to` when that is known."""

    code: ErrorCode
    message: str
    request_id: str | None
    reply_to: ReplyTo | None

    def error_result(self) -> ErrorResult | None:
        if self.request_id is None or self.reply_to is None:
            return None
        return ErrorResult(request_id=self.request_id, seq=0, code=self.code, message=self.message)


@dataclass(frozen=True)
class Duplicate:
    request_id: str


Decision = Admitted | Rejected | Duplicate


class RecentIds:
    """The last `size` request ids seen, to drop a request delivered twice."""

    def __init__(self, size: int = 100_000) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._size = size

    def seen(self, request_id: str) -> bool:
        if request_id in self._ids:
            self._ids.move_to_end(request_id)
            return True
        self._ids[request_id] = None
        if len(self._ids) > self._size:
            self._ids.popitem(last=False)
        return False


def admit(
    raw: bytes, key: bytes | None, topics: Topics, limits: RequestLimits, recent: RecentIds
) -> Decision:
    """Parse and validate one `tokenbus.requests` record; never raises on bad input."""
    key_id = _decode(key)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return Rejected(ErrorCode.invalid_request, f"record is not JSON: {exc}", key_id, None)
    if not isinstance(body, dict):
        return Rejected(ErrorCode.invalid_request, "record is not a JSON object", key_id, None)
    if "request_id" not in body and key_id is not None:
        body["request_id"] = key_id
    try:
        record = RequestRecord.model_validate(body, context={"limits": limits})
    except ValidationError as exc:
        request_id = body.get("request_id") if isinstance(body.get("request_id"), str) else key_id
        return Rejected(
            ErrorCode.invalid_request, error_message(exc), request_id, _reply_to(body, topics)
        )
    tier = record.priority or Tier.interactive
    reply_to = record.reply_to or ReplyTo(topic=topics.results)
    queued = QueuedRequest.from_record(record, tier=tier, reply_to=reply_to)
    budget = limits.max_request_tokens
    if budget is not None and queued.token_cost > budget:
        # No batch could ever hold it: refuse now rather than let it wait forever.
        message = (
            f"prompt (~{queued.prompt_tokens} tokens) plus max_tokens"
            f" ({queued.effective_max_tokens}) is {queued.token_cost} tokens, above the"
            f" largest batch token budget of {budget}"
        )
        return Rejected(ErrorCode.invalid_request, message, record.request_id, reply_to)
    if recent.seen(record.request_id):
        return Duplicate(record.request_id)
    return Admitted(queued, topics.tier(tier))


def _reply_to(body: dict[str, object], topics: Topics) -> ReplyTo | None:
    """Best effort: where to tell the requester about its bad request."""
    raw = body.get("reply_to")
    if raw is None:
        return ReplyTo(topic=topics.results)
    try:
        return ReplyTo.model_validate(raw)
    except ValidationError:
        return None


def _decode(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        return None
