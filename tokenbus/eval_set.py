"""An evaluation set for `tokenbus eval`: one JSON object per line, read and checked whole
before anything is sent, and the request each item becomes on a variant.

An item: `{"id": ..., "messages": [...] | "prompt": "...", "max_tokens"?, "temperature"?,
"seed"?, "reference"?}`. `temperature` unset is 0 (greedy): an evaluation compares what
each variant answers, and a greedy answer is that variant's own, not a draw. `reference`,
when given, is the answer each variant is also scored against.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, ValidationError

from shared.messages import (
    ChatMessage,
    ReplyTo,
    RequestRecord,
    Tier,
    error_message,
)
from shared.messages import (
    Model as Record,
)

MAX_ITEMS = 10_000


class EvalSetError(ValueError):
    """The set cannot be used: its message names the file and line (`FILE:LINE: why`)."""


class EvalItem(Record):
    """One line of the set."""

    id: str = Field(min_length=1, max_length=200, description="Names the item in the report.")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    reference: str | None = Field(default=None, description="The expected answer, if any.")

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: a faithful variant repeats the reference variant's answer."""
        return self.temperature == 0 or self.seed is not None

    def request(
        self,
        *,
        request_id: str,
        model: str,
        variant: str,
        reply_to: ReplyTo,
        deadline_ms: int,
        tier: Tier,
    ) -> RequestRecord:
        """The request that runs this item on `variant` of `model` (pinned, never cached);
        raises ValidationError where the item asks what no request may."""
        return RequestRecord.model_validate(
            {
                "request_id": request_id,
                "tenant": "eval",
                "messages": self.messages,
                "prompt": self.prompt,
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
                "seed": self.seed,
                "model": model,
                "variant": variant,
                "cache": False,
                "priority": tier,
                "deadline_ms": deadline_ms,
                "reply_to": reply_to,
            }
        )


def load_set(path: Path) -> list[EvalItem]:
    """Every item of the set at `path`, in order; raises EvalSetError on the first bad line
    (not JSON, not an item, a request no model could take, an id seen before), or if the
    file cannot be read or holds no item. Blank lines are skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalSetError(f"{path}: cannot be read: {exc}") from None
    items: list[EvalItem] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        item = _item(line, where)
        if item.id in seen:
            raise EvalSetError(f"{where}: id {item.id!r} again (first on line {seen[item.id]})")
        seen[item.id] = number
        items.append(item)
        if len(items) > MAX_ITEMS:
            raise EvalSetError(f"{where}: more than {MAX_ITEMS} items")
    if not items:
        raise EvalSetError(f"{path}: no item (one JSON object per line)")
    return items


def _item(line: str, where: str) -> EvalItem:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EvalSetError(f"{where}: not JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(value, dict):
        raise EvalSetError(f"{where}: an item is a JSON object, not {type(value).__name__}")
    try:
        item = EvalItem.model_validate(value)
        # What a request makes of it (one of messages or prompt, the prompt's bound, ...).
        item.request(
            request_id="check",
            model="check",
            variant="baseline",
            reply_to=ReplyTo(topic="check"),
            deadline_ms=1,
            tier=Tier.background,
        )
    except ValidationError as exc:
        raise EvalSetError(f"{where}: {error_message(exc)}") from None
    return item
