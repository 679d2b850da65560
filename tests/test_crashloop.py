"""The restart back-off of `tokenbus up`: doubling, capped, reset by a long enough run."""

from __future__ import annotations

from tokenbus.crashloop import Backoff, CrashLoop

BACKOFF = Backoff(initial_s=1.0, max_s=10.0, reset_after_s=60.0)


def test_delays_double_per_crash_in_a_row_up_to_the_cap() -> None:
    loop = CrashLoop(BACKOFF)
    assert [loop.next_delay(up_for_s=0.5) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert loop.crashes == 6


def test_a_run_as_long_as_the_reset_window_starts_the_back_off_afresh() -> None:
    loop = CrashLoop(BACKOFF)
    for _ in range(4):
        loop.next_delay(up_for_s=1.0)
    assert loop.next_delay(up_for_s=59.9) == 10.0  # just short of the window: still capped
    assert loop.next_delay(up_for_s=60.0) == 1.0
    assert loop.next_delay(up_for_s=0.0) == 2.0
