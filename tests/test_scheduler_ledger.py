"""The scheduler's offset ledger: what a commit says, and what a restart learns from it."""

from __future__ import annotations

from aiokafka import TopicPartition
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.ledger import Ledger, decode_metadata, encode_metadata

TP = TopicPartition("t.requests.interactive", 0)
FLOORS = {0: 10, 1: 4}


def test_out_of_order_hand_on_commits_the_oldest_pending_and_says_what_is_done_above() -> None:
    ledger = Ledger()
    ledger.restore(TP, None, "")
    for offset in range(5):
        assert ledger.read(TP, offset)
    for offset in (0, 2, 4):  # 1 and 3 still wait (a background request, say)
        ledger.handed_on(TP, offset)
    position, metadata = ledger.committable(FLOORS)[TP]
    assert position == 1
    restored = decode_metadata(position, metadata)
    assert restored.high == 5
    assert restored.pending == {1, 3}
    assert restored.floors == FLOORS


def test_a_restart_skips_what_the_commit_says_was_handed_on() -> None:
    before = Ledger()
    before.restore(TP, None, "")
    for offset in range(6):
        before.read(TP, offset)
    for offset in (0, 2, 3, 5):
        before.handed_on(TP, offset)
    position, metadata = before.committable(FLOORS)[TP]

    after = Ledger()
    restored = after.restore(TP, position, metadata)
    assert restored.floors == FLOORS
    # The consumer re-reads from the committed position.
    reread = [offset for offset in range(position, 8) if after.read(TP, offset)]
    assert reread == [1, 4, 6, 7]  # pending at the commit, and everything newer


def test_the_commit_never_passes_a_restored_pending_offset_not_yet_re_read() -> None:
    ledger = Ledger()
    ledger.restore(TP, 10, encode_metadata(10, 20, {10, 15}, FLOORS))
    assert not ledger.read(TP, 11)  # handed on before the restart
    assert ledger.read(TP, 10)
    ledger.handed_on(TP, 10)
    position, metadata = ledger.committable(FLOORS)[TP]
    assert position == 15  # 15 is pending from before and not read yet
    assert decode_metadata(position, metadata).pending == {15}


def test_an_unknown_or_foreign_metadata_string_says_nothing() -> None:
    assert decode_metadata(7, "").floors is None
    assert decode_metadata(7, "some other client's note").pending == frozenset()
    assert decode_metadata(7, '{"v": 99}').high == 7


def test_nothing_to_commit_when_nothing_moved() -> None:
    ledger = Ledger()
    ledger.restore(TP, None, "")
    ledger.read(TP, 0)
    ledger.handed_on(TP, 0)
    entries = ledger.committable(FLOORS)
    ledger.mark_committed(entries)
    assert ledger.committable(FLOORS) == {}
    assert ledger.committable({0: 11, 1: 4}) != {}  # new floors are worth a commit


def test_the_span_measures_how_far_reading_ran_ahead() -> None:
    ledger = Ledger()
    ledger.restore(TP, 100, "")
    for offset in range(100, 140):
        ledger.read(TP, offset)
    for offset in range(101, 140):
        ledger.handed_on(TP, offset)
    assert ledger.span(TP) == 40  # offset 100 still waits


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(0, 16_000),
    st.data(),
)
def test_metadata_round_trips_any_pending_set(
    position: int, span: int, data: st.DataObject
) -> None:
    pending = data.draw(
        st.sets(st.integers(position, position + span - 1)) if span else st.just(set())
    )
    encoded = encode_metadata(position, position + span, pending, FLOORS)
    assert len(encoded) <= 4096, "Kafka's default offset.metadata.max.bytes"
    restored = decode_metadata(position, encoded)
    assert restored.high == position + span
    assert restored.pending == pending
    assert restored.floors == FLOORS
