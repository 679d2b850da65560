"""Self-fencing: a worker silent past the death threshold starts a new epoch (pure)."""

from __future__ import annotations

from services.worker.fence import Fence


def test_heartbeats_stored_in_time_keep_the_epoch() -> None:
    fence = Fence(dead_after_s=3.0, last_stored=0.0)
    for t in range(1, 20):
        fence.stored(t - 0.5)
        assert fence.check(float(t)) == 0


def test_a_pause_past_the_threshold_fences_once_and_counts_as_a_fresh_start() -> None:
    fence = Fence(dead_after_s=3.0, last_stored=10.0)
    assert fence.check(13.0) == 0  # exactly at the threshold: not yet
    assert fence.check(25.0) == 1  # woken after SIGSTOP: the monotonic clock jumped
    assert fence.check(25.1) == 1  # once per silence
    fence.stored(25.2)
    assert fence.check(28.0) == 1
    assert fence.check(40.0) == 2  # silent again (a broker outage): fenced again


def test_a_late_acknowledgement_of_an_old_heartbeat_does_not_move_time_back() -> None:
    fence = Fence(dead_after_s=3.0, last_stored=10.0)
    fence.stored(12.0)
    fence.stored(11.0)  # acks may arrive out of order
    assert fence.silent_for(14.0) == 2.0
