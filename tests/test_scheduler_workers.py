"""Worker liveness and free slots from heartbeats, and what a dead worker leaves unfinished."""

from __future__ import annotations

from aiokafka import TopicPartition

from services.scheduler.batch_log import LoggedBatch
from services.scheduler.recovery import unfinished
from services.scheduler.workers import WorkerRegistry
from shared.messages import Batch, Heartbeat, QueuedRequest, ReplyTo, Tier

TP = TopicPartition("t.batches", 1)


def beat(worker: str = "w1", free: int = 4, consumed: int = 0, **extra: object) -> Heartbeat:
    fields: dict[str, object] = {
        "worker_id": worker,
        "model": "sim",
        "total_slots": 4,
        "free_slots": free,
        "running": 4 - free,
        "queued_tokens": 0,
        "utilisation": 0.0,
        "batch_partition": 1,
        "batches_consumed": consumed,
        "interval_ms": 100.0,
        "started_at": 1.0,
    }
    fields.update(extra)
    return Heartbeat.model_validate(fields)


def test_batches_sent_count_against_free_slots_until_a_heartbeat_acknowledges_them() -> None:
    registry = WorkerRegistry()
    registry.beat(beat(free=4, consumed=10), now=0.0)
    registry.dispatched("w1", offset=10, requests=3)
    assert [s.free for s in registry.slots(0.0)] == [1]
    registry.beat(beat(free=4, consumed=10), now=0.05)  # sent before it read batch 10
    assert [s.free for s in registry.slots(0.05)] == [1]
    registry.beat(beat(free=1, consumed=11), now=0.1)  # read it: its own count now
    assert [s.free for s in registry.slots(0.1)] == [1]


def test_a_worker_is_dead_after_its_missed_beats_and_reported_once() -> None:
    registry = WorkerRegistry(missed_beats=3)
    registry.beat(beat(), now=0.0)
    assert registry.newly_dead(0.3) == []
    dead = registry.newly_dead(0.31)
    assert [s.beat.worker_id for s in dead] == ["w1"]
    assert registry.newly_dead(0.5) == []
    assert registry.slots(0.5) == []


def test_a_worker_whose_last_beat_says_it_leaves_is_gone_at_once_without_a_wait() -> None:
    registry = WorkerRegistry(missed_beats=3)
    registry.beat(beat(sent_at=1.0), now=0.0)
    registry.beat(beat(free=0, sent_at=2.0), now=0.1, leaving=True)
    gone = registry.newly_dead(0.1)  # not after 0.3 s of silence
    assert [(s.beat.worker_id, s.leaving) for s in gone] == [("w1", True)]
    assert registry.slots(0.1) == []
    assert registry.newly_dead(0.5) == []  # reported once
    # A late copy of an earlier beat does not bring it back.
    registry.beat(beat(sent_at=1.0), now=0.2)
    assert registry.slots(0.2) == []


def test_a_slow_worker_that_beats_again_is_alive_again() -> None:
    registry = WorkerRegistry(missed_beats=3)
    registry.beat(beat(), now=0.0)
    registry.newly_dead(1.0)
    registry.beat(beat(), now=1.0)
    assert [s.worker_id for s in registry.slots(1.0)] == ["w1"]


def test_replayed_heartbeats_do_not_prove_life() -> None:
    registry = WorkerRegistry(missed_beats=3)
    registry.beat(beat(), now=0.0, replayed=True)  # read back at start-up
    assert registry.slots(0.0) == []
    assert [s.beat.worker_id for s in registry.newly_dead(0.4)] == ["w1"]
    fresh = WorkerRegistry()
    fresh.beat(beat(), now=0.0, replayed=True)
    fresh.beat(beat(), now=0.05)
    assert [s.worker_id for s in fresh.slots(0.05)] == ["w1"]


def test_a_new_incarnation_of_a_worker_id_starts_afresh() -> None:
    registry = WorkerRegistry()
    registry.beat(beat(), now=0.0)
    registry.dispatched("w1", offset=5, requests=4)
    registry.beat(beat(started_at=2.0), now=0.05)
    assert [s.free for s in registry.slots(0.05)] == [4]


def request(rid: str, attempt: int = 0) -> QueuedRequest:
    return QueuedRequest(
        request_id=rid,
        prompt="p",
        tier=Tier.interactive,
        prompt_tokens=1,
        reply_to=ReplyTo(topic="t.results"),
        attempt=attempt,
    )


def logged(offset: int, worker: str, *rids: str) -> LoggedBatch:
    batch = Batch(
        batch_id=f"b{offset}",
        tier=Tier.interactive,
        requests=[request(r) for r in rids],
        reason="timeout",
        worker_id=worker,
    )
    return LoggedBatch(TP, offset, batch)


def test_unfinished_is_what_the_worker_held_or_never_acknowledged() -> None:
    batches = [
        logged(10, "w1", "done", "held"),
        logged(11, "w2", "other-worker"),
        logged(12, "w1", "unread-1", "unread-2"),
    ]
    last = beat(consumed=12, held=[("held", 0)])
    assert [r.request_id for r in unfinished(batches, last)] == ["held", "unread-1", "unread-2"]
    again = unfinished(batches, last, exclude={("held", 0), ("unread-1", 0)})
    assert [r.request_id for r in again] == ["unread-2"]


def test_a_handed_back_request_is_the_next_attempt_of_the_same_request() -> None:
    first = request("r", attempt=1)
    again = first.next_attempt()
    assert again.attempt == 2
    assert again.model_dump(exclude={"attempt"}) == first.model_dump(exclude={"attempt"})


def test_a_dead_worker_is_forgotten_and_registers_afresh_when_it_comes_back() -> None:
    registry = WorkerRegistry(missed_beats=3)
    assert registry.beat(beat("w1"), now=0.0) is True  # registers
    assert registry.beat(beat("w1"), now=0.1) is False  # only beats
    assert [s.beat.worker_id for s in registry.newly_dead(now=1.0)] == ["w1"]
    registry.get("w1").handed_back.add(("r1", 0))  # type: ignore[union-attr]
    assert registry.forget("w1") is True
    assert len(registry) == 0
    assert registry.get("w1") is None
    # Back later (only paused, or restarted): a clean registration, nothing of the old state.
    assert registry.beat(beat("w1", free=4), now=5.0) is True
    state = registry.get("w1")
    assert state is not None
    assert state.dead_at is None
    assert state.handed_back == set()
    assert [s.worker_id for s in registry.slots(5.0)] == ["w1"]


def test_forget_refuses_a_worker_that_beat_again() -> None:
    registry = WorkerRegistry(missed_beats=3)
    registry.beat(beat("w1"), now=0.0)
    registry.newly_dead(now=1.0)
    registry.beat(beat("w1"), now=1.1)  # only slow
    assert registry.forget("w1") is False
    assert registry.get("w1") is not None


def test_dead_workers_are_dropped_after_a_while_so_memory_stays_bounded() -> None:
    registry = WorkerRegistry(missed_beats=3)
    for i in range(1000):  # workers coming and going under new ids (autoscaling)
        registry.beat(beat(f"w{i}"), now=float(i))
        registry.newly_dead(now=float(i) + 1.0)
    registry.beat(beat("alive"), now=1000.0)
    # w{i} was declared dead at i + 1: those before w880 have been dead for over 120 s.
    gone = registry.forget_dead(now=1000.5, after_s=120.0, keep={"w100"})
    assert len(gone) == 880 - 1  # except the kept one (a recovery pending for it)
    assert "w100" not in gone
    assert "w879" in gone
    assert "w880" not in gone
    assert len(registry) == 120 + 1 + 1
    assert registry.get("alive") is not None
    assert registry.get("w100") is not None


def test_copies_and_late_copies_of_a_beat_say_nothing_newer() -> None:
    """Each beat is on every partition of the workers topic (ADR 0056)."""
    registry = WorkerRegistry(missed_beats=3)
    older, newer = beat(free=4, sent_at=10.0), beat(free=1, sent_at=10.3)
    assert registry.beat(newer, now=0.0)
    assert not registry.beat(newer, now=0.2)  # its copy from another partition
    assert not registry.beat(older, now=0.25)  # a copy held back by a node away
    assert [s.free for s in registry.slots(0.25)] == [1]
    # Neither copy proved life: silent since the newer beat's arrival.
    assert [s.beat.worker_id for s in registry.newly_dead(0.31)] == ["w1"]


def test_a_late_copy_from_a_replaced_incarnation_does_not_register_it_again() -> None:
    registry = WorkerRegistry()
    registry.beat(beat(started_at=1.0, sent_at=5.0), now=0.0)
    assert registry.beat(beat(started_at=2.0, sent_at=6.0), now=0.1)  # fenced: a new one
    assert not registry.beat(beat(started_at=1.0, sent_at=5.9), now=0.2)  # the old one, late
    state = registry.get("w1")
    assert state is not None
    assert state.beat.started_at == 2.0
