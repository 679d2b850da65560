"""Lease-log rules (pure): who holds which result partition, as every reader decides it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.edge.deadlines import Deadlines
from services.edge.leases import LeaseBook, LeaseRecord

TTL = 1000


def rec(kind: str, holder: str, epoch: int, partition: int = 0) -> LeaseRecord:
    return LeaseRecord.model_validate(
        {"kind": kind, "partition": partition, "holder": holder, "epoch": epoch, "ttl_ms": TTL}
    )


def test_first_claim_of_an_epoch_wins_the_race() -> None:
    book = LeaseBook()
    assert book.apply(rec("claim", "a", 1), at_ms=0)
    assert not book.apply(rec("claim", "b", 1), at_ms=1)
    assert book.holder_at(0, 500) == "a"
    assert book.free_at(3, 500) == [1, 2]


def test_a_live_lease_cannot_be_claimed_even_with_a_higher_epoch() -> None:
    book = LeaseBook()
    book.apply(rec("claim", "a", 1), at_ms=0)
    assert not book.apply(rec("claim", "b", 2), at_ms=999)
    assert book.apply(rec("claim", "b", 2), at_ms=1000)  # lapsed at exactly ttl
    assert book.holder_at(0, 1500) == "b"


def test_renewals_keep_a_lease_and_a_late_renewal_does_not_revive_it() -> None:
    book = LeaseBook()
    book.apply(rec("claim", "a", 1), at_ms=0)
    assert book.apply(rec("renew", "a", 1), at_ms=900)
    assert book.holder_at(0, 1800) == "a"
    assert not book.apply(rec("renew", "a", 1), at_ms=1900)  # lapsed at 1900
    assert book.holder_at(0, 1900) is None


def test_a_renewal_of_an_old_epoch_is_ignored() -> None:
    book = LeaseBook()
    book.apply(rec("claim", "a", 1), at_ms=0)
    book.apply(rec("claim", "b", 2), at_ms=1500)
    assert not book.apply(rec("renew", "a", 1), at_ms=1600)
    assert book.holder_at(0, 1700) == "b"


def test_release_frees_at_once_and_only_by_its_holder() -> None:
    book = LeaseBook()
    book.apply(rec("claim", "a", 1), at_ms=0)
    assert not book.apply(rec("release", "b", 1), at_ms=10)
    assert book.apply(rec("release", "a", 1), at_ms=20)
    assert book.holder_at(0, 30) is None
    assert book.apply(rec("claim", "b", 2), at_ms=30)


def test_a_reader_that_lost_the_winning_claim_to_compaction_believes_the_renewal() -> None:
    # Compaction kept only the loser's claim; the winner's next renewal names the holder.
    book = LeaseBook()
    book.apply(rec("claim", "loser", 1), at_ms=5)
    assert book.apply(rec("renew", "winner", 1), at_ms=300)
    assert book.holder_at(0, 400) == "winner"
    assert not book.apply(rec("claim", "c", 2), at_ms=400)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["claim", "renew", "release"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(1, 4),
            st.integers(0, 700),
        ),
        max_size=40,
    )
)
def test_at_no_time_do_two_holders_both_believe_they_won(
    steps: list[tuple[str, str, int, int]],
) -> None:
    """Each edge thinks it holds the partition from its accepted claim or renewal until lapse.

    Renewals are only written by edges that won the epoch (as the keeper does); whatever the
    interleaving, the book never names two holders for one instant.
    """
    book = LeaseBook()
    won: dict[str, int] = {}  # holder -> epoch it won
    now = 0
    for kind, holder, epoch, gap in steps:
        now += gap
        if kind == "renew" and won.get(holder) != epoch:
            continue  # only a winner renews its epoch
        if kind == "claim":
            epoch = book.next_epoch(0)  # a keeper proposes the next epoch it has seen
        if book.apply(rec(kind, holder, epoch), at_ms=now) and kind == "claim":
            won[holder] = epoch
        lease = book.lease(0)
        if lease is not None and lease.live_at(now):
            assert won.get(lease.holder) == lease.epoch


def test_deadlines_fire_in_order_and_can_be_moved_or_cancelled() -> None:
    d: Deadlines[str] = Deadlines()
    d.set("a", 5.0)
    d.set("b", 1.0)
    d.set("c", 3.0)
    d.set("a", 2.0)  # moved earlier
    assert d.cancel("c")
    assert not d.cancel("c")
    assert d.next_at() == 1.0
    assert d.pop_due(1.5) == ["b"]
    assert d.pop_due(10.0) == ["a"]
    assert len(d) == 0
    assert d.next_at() is None
