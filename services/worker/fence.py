"""Self-fencing: a worker whose heartbeats stopped reaching Kafka may be declared dead.

Schedulers declare a worker dead after `missed_beats` heartbeat intervals without hearing
from it, and run its requests again elsewhere. A worker that was only paused (SIGSTOP, a
long GC or swap stall, a network partition) does not know it: when it resumes, its event
loop would go on writing the old attempts. So the worker keeps the monotonic time of its
last heartbeat that Kafka stored; once that is older than the death threshold, everything
running is *fenced*: it writes nothing more, and goes back to the schedulers as the next
attempt (a scheduler's intake drops the copy if its own recovery handed it back too).
The monotonic clock keeps counting while a process is stopped, so the first check after
SIGCONT sees the whole pause.

Pure: times in, decisions out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Fence:
    """Caller: the worker's heartbeat task (`stored`) and every writer (`check`)."""

    dead_after_s: float
    last_stored: float  # monotonic send time of the newest heartbeat Kafka acknowledged
    epoch: int = 0  # bumped by each fencing; a run started in an older epoch is fenced

    def stored(self, sent_at: float) -> None:
        """A heartbeat sent at `sent_at` (monotonic) is stored: proof of life up to then."""
        self.last_stored = max(self.last_stored, sent_at)

    def silent_for(self, now: float) -> float:
        return now - self.last_stored

    def check(self, now: float) -> int:
        """The current epoch, after fencing if the last stored heartbeat is too old.

        A fencing starts a new epoch and counts as proof of life from `now`: the worker
        comes back as a new incarnation, and its next heartbeat says so.
        """
        if now - self.last_stored > self.dead_after_s:
            self.epoch += 1
            self.last_stored = now
        return self.epoch
