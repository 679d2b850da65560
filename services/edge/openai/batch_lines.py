"""A batch input file (OpenAI's JSONL, as vLLM's `run_batch` reads it too), each line
checked as the endpoint it names would check its body: the first bad line refuses the
file, named by its number (issue 39)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.edge.auth import request_tokens
from services.edge.openai.errors import HttpError, invalid
from services.edge.openai.schema import ChatCompletionRequest, CompletionRequest
from services.edge.openai.translate import to_chat_request
from shared.messages import RequestLimits, error_message

# OpenAI's limits for a batch's input file.
MAX_FILE_BYTES = 200 * 1024 * 1024
MAX_LINES = 50_000
ENDPOINTS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


class BatchLine(BaseModel):
    """One request of a batch: `{"custom_id", "method": "POST", "url", "body"}`."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Checked:
    """A good file: its requests, and the tokens they may use (each one's prompt bound +
    max_tokens, as a request is charged: what a batch's quota counts)."""

    lines: int
    tokens: int


def check_lines(lines: Iterable[bytes], limits: RequestLimits) -> Checked | HttpError:
    """What the file holds, or the 400 naming its first bad line."""
    seen: set[str] = set()
    count = tokens = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue  # a blank line, as vLLM's run_batch skips them
        count += 1
        if count > MAX_LINES:
            return invalid(
                f"line {number}: a batch file holds at most {MAX_LINES} requests", "file"
            )
        checked = _check_line(raw, number, limits, seen)
        if isinstance(checked, HttpError):
            return checked
        tokens += checked
    if count == 0:
        return invalid("the file holds no request: one JSON request per line", "file")
    return Checked(count, tokens)


def _check_line(raw: bytes, number: int, limits: RequestLimits, seen: set[str]) -> HttpError | int:
    """The line's token bound, or why it is refused."""
    try:
        data = json.loads(raw)
    except RecursionError:
        return invalid(f"line {number}: JSON nested too deeply", "file")
    except ValueError:
        return invalid(f"line {number}: not valid JSON", "file")
    try:
        line = BatchLine.model_validate(data)
    except ValidationError as exc:
        return invalid(f"line {number}: {error_message(exc)}", "file")
    if line.custom_id in seen:
        return invalid(f"line {number}: custom_id {line.custom_id!r} is used twice", "file")
    seen.add(line.custom_id)
    endpoint = ENDPOINTS.get(line.url)
    if endpoint is None:
        known = " or ".join(ENDPOINTS)
        return invalid(f"line {number}: url {line.url!r} is not served here: {known}", "file")
    try:
        body = endpoint.model_validate(line.body)
    except ValidationError as exc:
        return invalid(f"line {number}: {error_message(exc)}", "file")
    if body.stream:
        return invalid(f"line {number}: a batch's requests do not stream", "file")
    asked = to_chat_request(body, limits)
    if isinstance(asked, HttpError):
        return invalid(f"line {number}: {asked.body.error.message}", "file")
    return request_tokens(asked)
