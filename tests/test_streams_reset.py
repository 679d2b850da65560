"""A `reset` record (the scheduler re-running a dead worker's request) at the edge's router.

It announces the next attempt, so whatever a paused worker writes of the old attempt
afterwards is dropped; it shows the client nothing itself: the new attempt's first record
decides whether the client sees a `chat.reset` (it starts over) or the answer going on
(tests/test_streams_continuation.py), and only one `chat.reset` per attempt.
"""

from __future__ import annotations

from pydantic import TypeAdapter

from shared.messages import ResetResult, ResultRecord
from tests.test_streams_router import RID, accepted_router, delta, done


def reset(attempt: int) -> ResetResult:
    return ResetResult(request_id=RID, attempt=attempt, reason="worker declared dead")


def test_a_reset_announces_the_attempt_and_later_records_of_older_ones_are_dropped() -> None:
    router, client = accepted_router()
    assert router.route(delta(0))
    assert router.route(delta(1))
    assert not router.route(reset(1))  # shows nothing by itself
    # The paused worker wakes and writes on: attempt 0 is superseded, nothing shown.
    assert not router.route(delta(2))
    assert not router.route(done(3))
    assert router.route(delta(0, attempt=1))
    assert router.route(done(1, attempt=1))
    assert client.kinds == [
        "chat.accepted",
        "chat.delta",
        "chat.delta",
        "chat.reset",
        "chat.delta",
        "chat.done",
    ]
    assert client.shown() == [(0, 0), (0, 1), (1, 0)]


def test_a_reset_for_the_attempt_already_shown_changes_nothing() -> None:
    router, client = accepted_router()
    assert router.route(delta(0))
    # The new attempt's first delta overtook the reset (another worker was quick).
    assert router.route(delta(0, attempt=1))
    assert not router.route(reset(1))
    assert router.route(delta(1, attempt=1))
    assert client.kinds.count("chat.reset") == 1
    assert client.shown() == [(0, 0), (1, 0), (1, 1)]


def test_a_new_attempt_before_any_text_was_shown_shows_no_reset() -> None:
    router, client = accepted_router()
    assert not router.route(reset(1))
    assert router.route(delta(0, attempt=1))
    assert router.route(done(1, attempt=1))
    assert client.kinds == ["chat.accepted", "chat.delta", "chat.done"]
    assert client.shown() == [(0, 0)]


def test_nothing_is_shown_after_done_not_even_a_reset() -> None:
    router, client = accepted_router()
    assert router.route(done(0))
    assert not router.route(reset(1))
    assert not router.route(delta(0, attempt=1))
    assert client.kinds == ["chat.accepted", "chat.done"]


def test_reset_records_parse_as_result_records_and_keep_json_compatible() -> None:
    adapter: TypeAdapter[ResultRecord] = TypeAdapter(ResultRecord)
    record = adapter.validate_json(b'{"kind":"reset","request_id":"r1","attempt":2}')
    assert record == ResetResult(request_id="r1", attempt=2, seq=0)
