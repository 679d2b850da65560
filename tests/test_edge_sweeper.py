"""The sweeper's rule, with plain values: which per-request topics are a crashed edge's."""

from __future__ import annotations

from services.edge.sweeper import OrphanBook, Sighting, request_topic
from shared.topics import Topics

ORPHAN_S = 60.0
RID = "0123456789abcdef0123456789abcdef"


def test_only_topics_an_edge_makes_are_candidates() -> None:
    topics = Topics("tb")
    assert request_topic(topics, f"tb.results.{RID}")
    assert not request_topic(topics, "tb.results")
    assert not request_topic(topics, "tb.results.leases")
    assert not request_topic(topics, f"other.results.{RID}")
    assert not request_topic(topics, "tb.results.my-own-id")  # an external producer's


def test_a_topic_with_only_old_records_is_due_at_once() -> None:
    book = OrphanBook(ORPHAN_S)
    old = Sighting(end_offset=12, written_since_cutoff=False)
    assert book.due(1000.0, {"a": old}) == ["a"]


def test_a_topic_written_recently_is_kept() -> None:
    book = OrphanBook(ORPHAN_S)
    live = Sighting(end_offset=12, written_since_cutoff=True)
    assert book.due(1000.0, {"a": live}) == []
    assert book.due(1000.0 + 10 * ORPHAN_S, {"a": live}) == []


def test_an_empty_topic_is_due_once_it_was_seen_empty_long_enough() -> None:
    # Empty: a request still queued, or one whose edge died before any result.
    book = OrphanBook(ORPHAN_S)
    empty = Sighting(end_offset=0, written_since_cutoff=False)
    assert book.due(1000.0, {"a": empty}) == []
    assert book.due(1000.0 + ORPHAN_S - 1, {"a": empty}) == []
    assert book.due(1000.0 + ORPHAN_S, {"a": empty}) == ["a"]


def test_a_topic_that_went_away_is_forgotten() -> None:
    book = OrphanBook(ORPHAN_S)
    empty = Sighting(end_offset=0, written_since_cutoff=False)
    assert book.due(1000.0, {"a": empty}) == []
    assert book.due(1000.0 + ORPHAN_S, {}) == []
    # Seen again (a new topic of the same name): its clock starts again.
    assert book.due(1000.0 + ORPHAN_S + 1, {"a": empty}) == []
