"""Outside applications at ingest (services/ingest/apps.py): who wrote a record, quotas."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.ingest.admission import Admitted, Reason, Rejected, admit
from services.ingest.apps import AppQuotas, Apps
from services.ingest.settings import IngestSettings
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
