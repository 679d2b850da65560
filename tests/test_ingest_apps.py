"""Outside applications at ingest (services/ingest/apps.py): who wrote a record, quotas."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.ingest.admission import (
    UNREAD_COPY_BYTES,
    Admitted,
    Reason,
    Rejected,
    admit,
    over_quota,
)
from services.ingest.apps import AppQuotas, Apps
from services.ingest.settings import IngestSettings
from shared.dead_letters import REQUEST_ID_HEADER, TRUNCATED, ReplyStatus, Source
from shared.messages import ErrorCode, RequestLimits
from shared.topics import Topics
from tokenbus.acls import Operation, Resource, app_acls, parse_apps

TOPICS = Topics("tb")
APPS = Apps(TOPICS, ["a", "b"])


def test_the_topic_names_the_app_and_the_shared_topic_none() -> None:
    b = APPS.of_topic("tb.app-requests.b")
    assert b is not None
    assert (b.name, b.tenant, b.replies) == ("b", "b", "tb.replies.b")
    assert APPS.of_topic(TOPICS.requests) is None
    assert APPS.topics == ["tb.app-requests.a", "tb.app-requests.b"]


def test_an_apps_request_gets_its_identity_from_the_topic() -> None:
    raw = b'{"request_id": "r1", "prompt": "hi"}'
    decision = admit(
        raw, None, TOPICS, RequestLimits(), set(), app=APPS.of_topic(TOPICS.app_requests("b"))
    )
    assert isinstance(decision, Admitted)
    request = decision.request
    assert (request.request_id, request.tenant, request.reply_to.topic) == (
        "b:r1",
        "b",
        "tb.replies.b",
    )


def test_dedupe_is_per_app() -> None:
    raw = b'{"request_id": "r1", "prompt": "hi"}'
    seen = {"a:r1"}  # A's r1 was handed on
    b = APPS.of_topic(TOPICS.app_requests("b"))
    a = APPS.of_topic(TOPICS.app_requests("a"))
    assert isinstance(admit(raw, None, TOPICS, RequestLimits(), seen, app=b), Admitted)
    assert not isinstance(admit(raw, None, TOPICS, RequestLimits(), seen, app=a), Admitted)


def test_a_scoped_id_over_the_protocols_length_is_refused_not_cut() -> None:
    raw = b'{"request_id": "' + b"x" * 127 + b'", "prompt": "hi"}'
    decision = admit(
        raw, None, TOPICS, RequestLimits(), set(), app=APPS.of_topic(TOPICS.app_requests("b"))
    )
    assert isinstance(decision, Rejected)
    assert decision.reason is Reason.invalid_field


def test_the_quota_refuses_past_the_burst_and_says_when_to_retry() -> None:
    quotas = AppQuotas(rate=2.0, burst=3)
    assert [quotas.charge("a", 0.0) for _ in range(3)] == [None, None, None]
    assert quotas.charge("a", 0.0) == 500  # one request every 0.5 s
    assert quotas.charge("b", 0.0) is None  # each app its own bucket
    assert quotas.charge("a", 0.25) == 250
    assert quotas.charge("a", 0.5) is None  # refilled; a refusal took nothing


def test_the_quota_counts_bytes_too_and_a_refusal_takes_nothing() -> None:
    quotas = AppQuotas(rate=100.0, burst=100, bytes_per_s=1000.0, burst_bytes=2000)
    assert quotas.charge("a", 0.0, 1500) is None
    assert quotas.charge("a", 0.0, 1000) == 500  # 500 bytes left: 500 more in 0.5 s
    assert quotas.charge("a", 0.0, 400) is None  # the refusal took nothing
    assert quotas.charge("a", 0.0, 5000) == 5000  # over the burst: as long as it takes to earn
    assert quotas.charge("b", 0.0, 2000) is None  # each app its own buckets


def test_a_record_over_the_quota_is_refused_unread_and_its_copy_is_short() -> None:
    app = APPS.of_topic(TOPICS.app_requests("b"))
    assert app is not None
    value = b'{"prompt": "' + b"x" * 500_000 + b'"}'
    refused = over_quota(app, b"r1", 250)
    assert (refused.reason, refused.code, refused.retry_after_ms) == (
        Reason.rate_limited,
        ErrorCode.rate_limited,
        250,
    )
    assert (refused.request_id, refused.reply_to and refused.reply_to.topic) == (
        "b:r1",
        app.replies,
    )
    letter = refused.dead_letter(
        value,
        b"r1",
        Source(app.requests, 0, 7),
        ReplyStatus.delivered,
        None,
        max_record_bytes=1_000_000,
        reader="ingest:test",
    )
    assert letter.value == value[:UNREAD_COPY_BYTES]
    assert letter.headers[TRUNCATED] == str(len(value))
    assert letter.headers[REQUEST_ID_HEADER] == "b:r1"
    # A key that is no request id: refused all the same, with nobody's id to answer under.
    assert over_quota(app, b"\xff", 10).request_id is None


def test_the_dlq_and_the_apps_topics_are_bounded_in_bytes_and_age() -> None:
    configs = {**TOPICS.configs(1000, 1000), **TOPICS.app_configs("b")}
    for topic in (TOPICS.dlq, TOPICS.app_requests("b"), TOPICS.app_replies("b")):
        assert int(configs[topic]["retention.bytes"]) == 1 << 30
        assert int(configs[topic]["retention.ms"]) == 7 * 24 * 3600 * 1000


def test_app_names_are_checked_at_start() -> None:
    assert IngestSettings(ingest_apps=" a, b ,a").apps == ("a", "b")
    with pytest.raises(ValidationError, match="does not match"):
        IngestSettings(ingest_apps="a.b")


def test_an_app_may_write_its_own_requests_and_read_its_own_replies_only() -> None:
    acls = app_acls(TOPICS, "b")
    topics = {(a.operation, a.name) for a in acls if a.resource is Resource.TOPIC}
    assert topics == {(Operation.WRITE, "tb.app-requests.b"), (Operation.READ, "tb.replies.b")}
    assert {a.principal for a in acls} == {"User:b"}
    assert parse_apps(["b", "c=User:c-prod", "d=dee"]) == {
        "b": "User:b",
        "c": "User:c-prod",
        "d": "User:dee",
    }
    with pytest.raises(ValueError, match="NAME"):
        parse_apps(["B.x"])


def test_a_rate_limited_error_carries_its_retry_hint() -> None:
    rejected = Rejected(Reason.rate_limited, ErrorCode.rate_limited, "slow down", "b:r1", None)
    assert rejected.error_result() is None  # nowhere to say it
