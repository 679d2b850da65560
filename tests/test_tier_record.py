"""The tier record (`QueuedRequest.from_record`), the one way ingest and the edge's direct path
build it (ADR 0041): built without validating again, it is the record validation would
have built (unit)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared.messages import QueuedRequest, ReplyTo, RequestLimits, RequestRecord, Tier

LIMITS = RequestLimits(default_max_tokens=64)
REPLY_TO = ReplyTo(topic="p.results", partition=2)


def record(**fields: Any) -> RequestRecord:
    base: dict[str, Any] = {"request_id": "r1", "tenant": "t1", "created_at": 100.0}
    return RequestRecord.model_validate({**base, **fields}, context={"limits": LIMITS})


RECORDS = {
    "prompt, defaults": {"prompt": "hi"},
    "messages, seeded, stop": {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 9,
        "seed": 3,
        "stop": ["END"],
        "priority": "background",
    },
    "own reply_to, deadline": {"prompt": "hi", "reply_to": REPLY_TO.model_dump(), "deadline_ms": 5},
}


@pytest.mark.parametrize("fields", RECORDS.values(), ids=RECORDS.keys())
@pytest.mark.parametrize("prompt_tokens", [None, 40])
def test_the_tier_record_built_without_validation_is_the_validated_record(
    fields: dict[str, Any], prompt_tokens: int | None
) -> None:
    source = record(**fields)
    built = QueuedRequest.from_record(
        source, tier=Tier.background, reply_to=REPLY_TO, prompt_tokens=prompt_tokens
    )
    validated = QueuedRequest.model_validate(
        {
            **source.model_dump(),
            "tier": Tier.background,
            "reply_to": REPLY_TO.model_dump(),
            "prompt_tokens": source.prompt_token_bound() if prompt_tokens is None else 40,
            "accepted_at": built.accepted_at,
        }
    )
    assert json.loads(built.model_dump_json()) == json.loads(validated.model_dump_json())
    # What a reader of the tier topic parses back is the same request.
    read = QueuedRequest.model_validate_json(built.model_dump_json(), context={"limits": LIMITS})
    assert read == built
    # The output estimate of the limits it was validated under goes along.
    assert built.effective_max_tokens == source.effective_max_tokens
    assert source.created_at <= built.accepted_at


def test_the_records_own_reply_to_is_taken_when_none_is_given() -> None:
    built = QueuedRequest.from_record(
        record(prompt="hi", reply_to=REPLY_TO.model_dump()), tier=Tier.interactive
    )
    assert built.reply_to == REPLY_TO


def test_a_tier_record_without_a_reply_to_or_with_negative_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="r1: a tier record needs a reply_to"):
        QueuedRequest.from_record(record(prompt="hi"), tier=Tier.interactive)
    with pytest.raises(ValueError, match="prompt_tokens -1 < 0"):
        QueuedRequest.from_record(
            record(prompt="hi"), tier=Tier.interactive, reply_to=REPLY_TO, prompt_tokens=-1
        )
