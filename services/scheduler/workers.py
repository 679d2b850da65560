"""What the scheduler knows of each worker: free slots from heartbeats, liveness, where to send.

Pure: heartbeats and this scheduler's own dispatches in, `WorkerSlots` and deaths out.
A heartbeat's `free_slots` already counts every batch the worker has read
(`batches_consumed`); batches this scheduler sent beyond that are subtracted until a
heartbeat acknowledges them, so two ticks between heartbeats never overfill a worker.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field

from services.scheduler.policy import WorkerSlots
from shared.messages import Heartbeat

# Weight of the newest finished request in a worker's service time (moving average).
SERVICE_SMOOTHING = 0.2


@dataclass
class WorkerState:
    beat: Heartbeat
    seen_at: float  # this scheduler's clock when the latest heartbeat arrived
    unacked: dict[int, int] = field(default_factory=dict)  # batch offset -> requests
    dead_at: float | None = None
    # Only heartbeats read as they happen prove life; ones replayed at start-up only say
    # the worker existed (it may have died while this scheduler was down).
    heard_live: bool = False
    # (request_id, attempt) already handed back for this worker: never twice, even if a
    # worker wrongly declared dead comes back and later dies for real.
    handed_back: set[tuple[str, int]] = field(default_factory=set)
    # When each request it holds was first seen held, and how long one holds a slot
    # (smoothed over the requests seen to finish): the fallback estimate's service time.
    held_since: dict[tuple[str, int], float] = field(default_factory=dict)
    service_s: float | None = None
    # Its last beat said it leaves (drained, held nothing more: `LEAVING_HEADER`).
    leaving: bool = False

    def observe_held(self, held: list[tuple[str, int]], now: float) -> None:
        """Requests that left `held` since the last heartbeat finished (or were handed back)."""
        current = set(held)
        for key in [k for k in self.held_since if k not in current]:
            took = now - self.held_since.pop(key)
            self.service_s = (
                took
                if self.service_s is None
                else (1 - SERVICE_SMOOTHING) * self.service_s + SERVICE_SMOOTHING * took
            )
        for key in current:
            self.held_since.setdefault(key, now)

    @property
    def partition(self) -> int | None:
        return self.beat.batch_partition

    def free(self) -> int:
        if self.beat.batch_mode == "static" and self.unacked:
            return 0  # a static worker takes one batch at a time, whatever its size
        return max(0, self.beat.free_slots - sum(self.unacked.values()))


class WorkerRegistry:
    """Live and dead workers by id; a worker is dead after `missed_beats` silent intervals."""

    def __init__(self, missed_beats: int = 3) -> None:
        self.missed_beats = missed_beats
        self._workers: dict[str, WorkerState] = {}

    def beat(
        self, beat: Heartbeat, now: float, *, replayed: bool = False, leaving: bool = False
    ) -> bool:
        """Record a heartbeat; it acknowledges every batch below its `batches_consumed`.
        `leaving`: the worker's last beat (`LEAVING_HEADER`): it is gone at once.

        True if it registers a worker: a new id, or a new incarnation of a known one.
        """
        state = self._workers.get(beat.worker_id)
        if state is not None and beat.started_at < state.beat.started_at:
            return False  # a late copy from an incarnation already replaced (ADR 0056)
        if state is None or state.beat.started_at != beat.started_at:
            # New, or a new incarnation of the id.
            state = self._workers[beat.worker_id] = WorkerState(beat, now, heard_live=not replayed)
            state.leaving = leaving
            if not replayed:
                state.observe_held(beat.held, now)
            return True
        if beat.sent_at <= state.beat.sent_at:
            # Each beat is on every partition of the topic (ADR 0056): its other copies, and
            # a copy held back by a node away, say nothing newer.
            return False
        # A worker declared dead that beats again was only slow: it is alive again (what it
        # held has been handed back; `handed_back` keeps that from happening twice).
        state.dead_at = None
        if state.beat.batch_partition != beat.batch_partition:
            state.unacked.clear()  # offsets of another partition mean nothing here
        state.beat = beat
        state.seen_at = now
        state.leaving = leaving
        state.heard_live = state.heard_live or not replayed
        if not replayed:
            state.observe_held(beat.held, now)
        for offset in [o for o in state.unacked if o < beat.batches_consumed]:
            del state.unacked[offset]
        return False

    def dispatched(self, worker_id: str, offset: int, requests: int) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.unacked[offset] = requests

    def slots(self, now: float) -> list[WorkerSlots]:
        """Every live worker with a batch partition, and what it can take now."""
        return [
            WorkerSlots(
                worker_id,
                s.free(),
                s.beat.total_slots,
                s.beat.queued_tokens,
                model=s.beat.model,
                variant=s.beat.variant,
                service_s=s.service_s,
            )
            for worker_id, s in sorted(self._workers.items())
            if s.heard_live
            and s.dead_at is None
            and s.partition is not None
            and not self._silent(s, now)
        ]

    def models(self) -> set[str]:
        """Every model a known worker serves (live or not yet forgotten): not unknown."""
        return {s.beat.model for s in self._workers.values()}

    def partition_of(self, worker_id: str) -> int:
        partition = self._workers[worker_id].partition
        assert partition is not None, "only workers with a partition get batches"
        return partition

    def newly_dead(self, now: float) -> list[WorkerState]:
        """Workers silent for `missed_beats` intervals, or whose last beat said they leave
        (at once), each reported once per death."""
        out = []
        for state in self._workers.values():
            if state.dead_at is None and (state.leaving or self._silent(state, now)):
                state.dead_at = now
                out.append(state)
        return out

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def forget(self, worker_id: str) -> bool:
        """Drop a worker that is still dead (its work is recovered); False if it came back.

        A worker heard of again later registers afresh, like a new one.
        """
        state = self._workers.get(worker_id)
        if state is None or state.dead_at is None:
            return False
        del self._workers[worker_id]
        return True

    def forget_dead(self, now: float, after_s: float, keep: Set[str] = frozenset()) -> list[str]:
        """Drop workers dead for more than `after_s` (except `keep`); return their ids.

        Bounds memory when workers come and go (autoscaling, restarts under new ids).
        """
        gone = [
            worker_id
            for worker_id, state in self._workers.items()
            if state.dead_at is not None and now - state.dead_at > after_s and worker_id not in keep
        ]
        for worker_id in gone:
            del self._workers[worker_id]
        return gone

    def __len__(self) -> int:
        return len(self._workers)

    def consumed(self) -> dict[int, int]:
        """Per batch partition, the furthest any worker has read (a floor for new batches)."""
        out: dict[int, int] = {}
        for s in self._workers.values():
            if s.partition is not None:
                out[s.partition] = max(out.get(s.partition, 0), s.beat.batches_consumed)
        return out

    def _silent(self, state: WorkerState, now: float) -> bool:
        return now - state.seen_at > self.missed_beats * state.beat.interval_ms / 1000.0
