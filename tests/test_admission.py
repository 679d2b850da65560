"""Ingest's admission decisions on raw records, without Kafka."""

from __future__ import annotations

import json

from services.ingest.admission import Admitted, Duplicate, RecentIds, Rejected, admit
from shared.messages import RequestLimits, Tier
from shared.topics import Topics

TOPICS = Topics("tb")
LIMITS = RequestLimits()


def decide(body: object, key: bytes | None = b"r1", recent: RecentIds | None = None) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return admit(raw, key, TOPICS, LIMITS, recent or RecentIds())


def test_valid_record_goes_to_its_tier_with_a_token_estimate() -> None:
    d = decide({"request_id": "r1", "prompt": "hello there world", "priority": "background"})
    assert isinstance(d, Admitted)
    assert d.topic == "tb.requests.background"
    assert d.request.tier is Tier.background
    assert d.request.prompt_tokens == 3
    assert d.request.reply_to.topic == "tb.results"  # no reply_to: the shared results topic


def test_default_tier_is_interactive_and_key_names_the_request() -> None:
    d = decide({"prompt": "hi"}, key=b"from-key")
    assert isinstance(d, Admitted)
    assert d.request.request_id == "from-key"
    assert d.topic == "tb.requests.interactive"


def test_not_json_is_rejected_without_reply() -> None:
    d = decide(b"\x00garbage")
    assert isinstance(d, Rejected)
    assert d.reply_to is None
    assert d.error_result() is None
    assert "not JSON" in d.message


def test_invalid_field_is_rejected_and_answered_on_reply_to() -> None:
    d = decide({"request_id": "r9", "prompt": "hi", "top_p": 7, "reply_to": {"topic": "mine"}})
    assert isinstance(d, Rejected)
    assert "top_p" in d.message
    error = d.error_result()
    assert error is not None
    assert error.request_id == "r9"
    assert d.reply_to is not None
    assert d.reply_to.topic == "mine"


def test_bad_reply_to_means_no_answer_but_still_dlq() -> None:
    d = decide({"request_id": "r9", "prompt": "hi", "reply_to": {"topic": "bad topic!"}})
    assert isinstance(d, Rejected)
    assert d.reply_to is None
    assert d.error_result() is None


def test_duplicate_request_id_is_dropped() -> None:
    recent = RecentIds()
    assert isinstance(decide({"prompt": "a"}, recent=recent), Admitted)
    assert isinstance(decide({"prompt": "a"}, recent=recent), Duplicate)


def test_recent_ids_forget_the_oldest() -> None:
    recent = RecentIds(size=2)
    for rid in ("a", "b", "c"):
        assert not recent.seen(rid)
    assert not recent.seen("a")
    assert recent.seen("c")
