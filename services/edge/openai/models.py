"""Which models are served now: the models live workers advertise in their heartbeats.

Pure: heartbeats and the clock are passed in. A worker counts as live while its last
heartbeat is younger than `stale_s`; the edge reads heartbeats from `tokenbus.workers`
with its one consumer (`ResultReader`'s side partitions).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import Heartbeat


@dataclass
class _Seen:
    model: str
    last_at: float  # when its latest heartbeat was sent (the worker's clock, Unix seconds)


class ModelDirectory:
    """worker_id -> the model it advertised last, and when.

    Caller: the edge's result reader (`observe`) and the HTTP handlers (`served`), on one
    event loop.
    Affects: only itself.
    """

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._workers: dict[str, _Seen] = {}
        self._first_seen: dict[str, float] = {}  # model -> when it was first advertised

    def observe(self, beat: Heartbeat) -> None:
        seen = self._workers.get(beat.worker_id)
        if seen is not None and seen.last_at > beat.sent_at:
            return  # an older beat, read late
        self._workers[beat.worker_id] = _Seen(beat.model, beat.sent_at)
        self._first_seen.setdefault(beat.model, beat.sent_at)

    def served(self, now: float) -> dict[str, int]:
        """Model name -> when it was first seen (Unix seconds), for every live worker's model."""
        for worker_id in [w for w, s in self._workers.items() if now - s.last_at > self.stale_s]:
            del self._workers[worker_id]
        live = {s.model for s in self._workers.values()}
        for model in [m for m in self._first_seen if m not in live]:
            del self._first_seen[model]
        return {m: int(self._first_seen[m]) for m in sorted(live)}
