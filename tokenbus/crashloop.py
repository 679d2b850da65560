"""Restart back-off for the processes `tokenbus up` supervises, as Kubernetes' CrashLoopBackOff."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Wait `initial_s` before the first restart, twice as long after each further crash up
    to `max_s`; a process that stayed up `reset_after_s` starts afresh."""

    initial_s: float
    max_s: float
    reset_after_s: float


@dataclass
class CrashLoop:
    """One supervised process's crashes in a row.

    Caller: the supervisor, once per exit it notices.
    Affects: `crashes`.
    """

    backoff: Backoff
    crashes: int = 0

    def next_delay(self, up_for_s: float) -> float:
        """Record an exit after `up_for_s` seconds up; return how long to wait to restart."""
        if up_for_s >= self.backoff.reset_after_s:
            self.crashes = 0
        delay = min(self.backoff.max_s, self.backoff.initial_s * 2.0**self.crashes)
        self.crashes += 1
        return delay
