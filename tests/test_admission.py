"""Ingest's admission decisions on raw records, without Kafka."""

from __future__ import annotations

import json

import pytest

from services.ingest.admission import (
    Admitted,
    Decision,
    Duplicate,
    Reason,
    Recent,
    RecentIds,
    Rejected,
    admit,
)
from services.ingest.apps import Apps
from shared.dead_letters import (
    REASON,
    REPLY,
    SOURCE,
    TRUNCATED,
    ReplyStatus,
    Source,
)
from shared.messages import ErrorCode, QueuedRequest, RequestLimits, Tier
from shared.tokens import prompt_token_bound
from shared.topics import Topics

TOPICS = Topics("tb")
LIMITS = RequestLimits()


def decide(
    body: object, key: bytes | None = b"r1", recent: RecentIds | None = None, **kw: int
) -> Decision:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return admit(raw, key, TOPICS, LIMITS, recent or RecentIds(), **kw)


def rejected(body: object, key: bytes | None = b"r1", **kw: int) -> Rejected:
    d = decide(body, key, **kw)
    assert isinstance(d, Rejected), d
    return d


def test_valid_record_goes_to_its_tier_with_a_token_bound() -> None:
    d = decide({"request_id": "r1", "prompt": "hello there world", "priority": "background"})
    assert isinstance(d, Admitted)
    assert d.topic == "tb.requests.background"
    assert d.request.tier is Tier.background
    assert d.request.prompt_tokens == prompt_token_bound("hello there world")  # 17 bytes + 40
    assert d.request.reply_to.topic == "tb.results"  # no reply_to: the shared results topic
    assert QueuedRequest.model_validate_json(d.value) == d.request


def test_default_tier_is_interactive_and_key_names_the_request() -> None:
    d = decide({"prompt": "hi"}, key=b"from-key")
    assert isinstance(d, Admitted)
    assert d.request.request_id == "from-key"
    assert d.topic == "tb.requests.interactive"


def test_not_json_is_rejected_without_reply() -> None:
    d = rejected(b"\x00garbage")
    assert d.reason is Reason.not_json
    assert d.reply_to is None
    assert d.error_result() is None
    assert "not valid JSON" in d.message


@pytest.mark.parametrize(
    "raw",
    [
        b'{"request_id": "r1", "prompt": "\\ud800"}',  # escaped lone surrogate
        b'{"request_id": "r1", "prompt": "\xed\xa0\x80"}',  # the surrogate as raw bytes
        b'{"request_id": "r1", "prompt": "\xff\xfe"}',  # not UTF-8 at all
        b'{"request_id": "r1", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # too deep
        b'{"request_id": "r1", "prompt": "hi"',  # cut short
        b"",
    ],
)
def test_invalid_unicode_and_deep_nesting_are_not_json(raw: bytes) -> None:
    d = rejected(raw)
    assert d.reason is Reason.not_json


def test_json_that_is_not_an_object_is_rejected() -> None:
    assert rejected([1, 2]).reason is Reason.not_object
    assert rejected("a string").reason is Reason.not_object


def test_invalid_field_is_rejected_and_answered_on_reply_to() -> None:
    d = rejected({"request_id": "r9", "prompt": "hi", "top_p": 7, "reply_to": {"topic": "mine"}})
    assert d.reason is Reason.invalid_field
    assert "top_p" in d.message
    error = d.error_result()
    assert error is not None
    assert error.request_id == "r9"
    assert d.reply_to is not None
    assert d.reply_to.topic == "mine"


def test_unknown_field_is_rejected_naming_it_as_the_edge_does() -> None:
    d = rejected({"request_id": "r9", "prompt": "hi", "colour": "red"})
    assert d.reason is Reason.invalid_field
    assert "colour" in d.message
    assert "red" not in d.message


def test_no_value_of_the_record_reaches_the_message() -> None:
    secret = "sk-live-0123456789abcdef"
    d = rejected({"request_id": "r9", "prompt": 5, "api_key": secret, "tenant": secret * 20})
    assert secret not in d.message
    assert "api_key" in d.message


def test_bad_reply_to_means_no_answer_but_still_dlq() -> None:
    d = rejected({"request_id": "r9", "prompt": "hi", "reply_to": {"topic": "bad topic!"}})
    assert d.reply_to is None
    assert d.error_result() is None


def test_an_id_outside_the_protocol_is_never_put_in_an_error_result() -> None:
    d = rejected({"request_id": "has space", "prompt": 1}, key=b"\xff")
    assert d.request_id is None
    assert d.error_result() is None
    d = rejected({"prompt": 1}, key=b"ok-key")
    assert d.request_id == "ok-key"
    assert d.error_result() is not None


@pytest.mark.parametrize("topic", ["tb.requests", "tb.requests.interactive", "tb.batches"])
def test_reply_to_a_pipeline_topic_is_refused(topic: str) -> None:
    d = rejected({"request_id": "r9", "prompt": "hi", "reply_to": {"topic": topic}})
    assert d.reason is Reason.reply_to_reserved
    assert d.error_result() is None  # the one place that would hear of it is the bad topic


def test_per_request_result_topics_are_fine_as_reply_to() -> None:
    d = decide({"request_id": "r9", "prompt": "hi", "reply_to": {"topic": "tb.results.r9"}})
    assert isinstance(d, Admitted)


@pytest.mark.parametrize(
    "field",
    [
        {"created_at": float("inf")},
        {"created_at": float("nan")},
        {"deadline_ms": 10**30},
        {"max_tokens": 10**30},
        {"tenant": "t" * 129},
    ],
)
def test_values_no_service_could_compute_with_are_refused(field: dict[str, object]) -> None:
    raw = json.dumps({"request_id": "r9", "prompt": "hi", **field}).encode()  # NaN, Infinity
    assert rejected(raw).reason is Reason.invalid_field


def test_a_tier_record_above_the_record_limit_is_refused() -> None:
    d = rejected({"request_id": "r9", "prompt": "x" * 20_000}, max_record_bytes=10_000)
    assert d.reason is Reason.too_large
    assert d.error_result() is not None


def test_duplicate_request_id_is_dropped_only_once_remembered() -> None:
    recent = RecentIds()
    assert isinstance(decide({"prompt": "a"}, recent=recent), Admitted)
    # Not remembered yet (its publish has not succeeded): admitted again.
    assert isinstance(decide({"prompt": "a"}, recent=recent), Admitted)
    recent.remember("r1")
    assert isinstance(decide({"prompt": "a"}, recent=recent), Duplicate)


def test_recent_forgets_the_oldest() -> None:
    recent: Recent[str] = Recent(size=2)
    for rid in ("a", "b", "c"):
        recent.remember(rid)
    assert "a" not in recent
    assert "b" in recent
    assert "c" in recent
    recent.remember("b")  # refreshed: now "c" is the oldest
    recent.remember("d")
    assert "c" not in recent
    assert "b" in recent


def test_source_round_trips_through_its_header_text() -> None:
    source = Source("tb.requests", 3, 1234)
    assert Source.parse(str(source)) == source
    assert Source.parse("no-slashes") is None
    assert Source.parse("t/x/1") is None


def test_a_dead_letter_near_the_record_limit_is_truncated_and_says_so() -> None:
    body = json.dumps({"request_id": "r9", "prompt": 1, "pad": "x" * 1_100_000}).encode()
    d = rejected(body)
    source = Source("tb.requests", 0, 7)
    letter = d.dead_letter(
        body, b"r9", source, ReplyStatus.delivered, None, max_record_bytes=1_000_000, reader="i"
    )
    size = len(letter.value) + len(letter.key or b"")
    size += sum(len(k) + len(v.encode()) for k, v in letter.headers.items())
    assert size <= 1_000_000 - 1024
    assert letter.headers[TRUNCATED] == str(len(body))
    assert letter.headers[REASON] == "invalid_field"
    assert letter.headers[SOURCE] == "tb.requests/0/7"
    assert letter.headers[REPLY] == "delivered"
    assert body.startswith(letter.value)
    small = d.dead_letter(
        b"{}", None, source, ReplyStatus.none, None, max_record_bytes=1_000_000, reader="i"
    )
    assert small.value == b"{}"
    assert TRUNCATED not in small.headers


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("variant", "nope", Reason.variant_forbidden),
        ("variant", "baseline", Reason.variant_forbidden),
        ("created_at", 4102444800.0, Reason.created_at_forbidden),  # 2100: no deadline passes
        ("created_at", 0.0, Reason.created_at_forbidden),  # 1970: every TTFT a failure
    ],
)
def test_an_apps_record_may_not_pin_a_variant_or_set_its_clock(
    field: str, value: object, reason: Reason
) -> None:
    """Issue 37, N3 and N7: an application's pin to a variant no worker declares was held for
    ever, holding its tier partition for every tenant; its own `created_at` moved its
    deadline and the TTFT a canary is judged by. Refused, `unauthorized`, to its own topic;
    a trusted writer (the edge, on the shared topic) still sets both."""
    body = {"request_id": "r1", "prompt": "hi", field: value}
    raw = json.dumps(body).encode()
    app = Apps(TOPICS, ["b"]).of_topic(TOPICS.app_requests("b"))
    refused = admit(raw, None, TOPICS, RequestLimits(), set(), app=app)
    assert isinstance(refused, Rejected), refused
    assert refused.reason is reason
    assert refused.code is ErrorCode.unauthorized
    assert refused.message.startswith(f"{field}: app b ")
    assert refused.reply_to is not None
    assert refused.reply_to.topic == TOPICS.app_replies("b")
    trusted = admit(raw, None, TOPICS, RequestLimits(), set())
    assert isinstance(trusted, Admitted), trusted
    assert getattr(trusted.request, field) == value
