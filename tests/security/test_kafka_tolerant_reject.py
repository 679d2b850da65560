"""A record the strict parser refuses is still answered where it can be read to say where.

The attacker here is only unlucky: a producer whose JSON holds an escaped lone surrogate
(`"a\\ud800b"`, valid JSON syntax, not valid Unicode) used to be dead-lettered as "not JSON"
with no error to its readable `reply_to`, so it waited forever. Pure: `admit` decides what
ingest answers (the secured, end-to-end case is in test_kafka_identity.py).
"""

from __future__ import annotations

import pytest

from services.ingest.admission import Reason, Rejected, admit
from services.ingest.apps import Apps
from shared.messages import ErrorCode, RequestLimits
from shared.topics import Topics

TOPICS = Topics("tb")
SURROGATE = b'"prompt": "a\\ud800b"'  # the six characters \ud800, escaped in JSON


def rejected(raw: bytes, key: bytes | None = None, app: str | None = None) -> Rejected:
    source = Apps(TOPICS, [app]).of_topic(TOPICS.app_requests(app)) if app else None
    decision = admit(raw, key, TOPICS, RequestLimits(), set(), app=source)
    assert isinstance(decision, Rejected), decision
    return decision


@pytest.mark.parametrize(
    "surrogate",
    [SURROGATE, b'"prompt": "a\xed\xa0\x80b"'],  # escaped, or as raw (CESU-8) bytes
)
def test_a_lone_surrogate_record_gets_its_error_on_its_reply_to(surrogate: bytes) -> None:
    raw = b'{"request_id": "r1", ' + surrogate + b', "reply_to": {"topic": "mine"}}'
    decision = rejected(raw)
    assert decision.reason is Reason.not_json
    error = decision.error_result()
    assert error is not None
    assert (error.request_id, error.code) == ("r1", ErrorCode.invalid_request)
    assert decision.reply_to is not None
    assert decision.reply_to.topic == "mine"
    assert "JSON" in error.message


def test_the_request_id_may_come_from_the_key() -> None:
    decision = rejected(b"{" + SURROGATE + b', "reply_to": {"topic": "mine"}}', key=b"k1")
    error = decision.error_result()
    assert error is not None
    assert error.request_id == "k1"


def test_an_apps_unreadable_record_is_answered_on_its_own_reply_topic() -> None:
    raw = b'{"request_id": "r1", ' + SURROGATE + b', "reply_to": {"topic": "tb.replies.a"}}'
    decision = rejected(raw, app="b")  # names another app's topic: still B's own
    error = decision.error_result()
    assert error is not None
    assert error.request_id == "b:r1"
    assert decision.reply_to is not None
    assert decision.reply_to.topic == TOPICS.app_replies("b")


def test_a_tolerant_reading_never_names_a_topic_of_tokenbus_itself() -> None:
    raw = b'{"request_id": "r1", ' + SURROGATE + b', "reply_to": {"topic": "tb.batches"}}'
    assert rejected(raw).error_result() is None


@pytest.mark.parametrize(
    "raw",
    [
        b'{"request_id": "r1", "prompt": "\xff", "reply_to": {"topic": "m"}}',  # not UTF-8
        b'{"request_id": "r1", "reply_to": {"topic": "m"}, "p": ' + b"[" * 100_000,  # too deep
        b"\x00garbage",
    ],
)
def test_what_cannot_be_read_at_all_is_still_dead_lettered_without_a_reply(raw: bytes) -> None:
    decision = rejected(raw)
    assert decision.reason is Reason.not_json
    assert decision.error_result() is None
