"""Which models are served now: the models live workers advertise in their heartbeats.

Pure: heartbeats and the clock are passed in. A worker counts as live while its last
heartbeat is younger than `stale_s`; the edge reads heartbeats from `tokenbus.workers`
with its one consumer (`ResultReader`'s side partitions).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from shared.cascades import Route
from shared.messages import (
    BASE_SAMPLING,
    Capabilities,
    ChatRequest,
    Heartbeat,
    unknown_model_message,
)

# A new edge refuses no model as unknown before it has listened this long: it reads the
# heartbeats of the last `stale_s` back on start, and a worker beats every second or so.
UNKNOWN_AFTER_S = 3.0


# What a worker from before heartbeats carried capabilities is taken to honour.
OLD_WORKER = Capabilities(engine="unknown", sampling=BASE_SAMPLING)


@dataclass
class _Seen:
    model: str
    sent_at: float  # when its latest heartbeat was sent (the worker's clock, Unix seconds)
    last_at: float  # when this edge heard it (this edge's clock: staleness is judged on it)
    max_model_len: int | None = None
    capabilities: Capabilities = OLD_WORKER


class ModelDirectory:
    """worker_id -> the model it advertised last, and when.

    Caller: the edge's result reader (`observe`) and the HTTP handlers (`served`), on one
    event loop.
    Affects: only itself.
    """

    def __init__(
        self,
        stale_s: float,
        listening_since: float | None = None,
        grace_s: float = UNKNOWN_AFTER_S,
        pooled: frozenset[str] = frozenset(),
        routes: Mapping[str, Route] | None = None,
    ) -> None:
        self.stale_s = stale_s
        # Routes (TOKENBUS_ROUTES): names taken as models, each running its cascade's models.
        self.routes = dict(routes or {})
        # Known while none of their workers is live: the scheduler holds their requests
        # while a worker starts (`served_models`, services/scheduler/cold_start.py).
        self.pooled = pooled
        self.listening_since = time.time() if listening_since is None else listening_since
        self.grace_s = grace_s
        self._workers: dict[str, _Seen] = {}
        self._first_seen: dict[str, float] = {}  # model -> when it was first advertised

    def observe(self, beat: Heartbeat, heard_at: float) -> None:
        """A heartbeat this edge read at `heard_at` (its own clock). Whether a worker is live
        is judged on when it was heard, not on its `sent_at`: a worker whose clock runs behind
        would otherwise drop off the list while it beats (issue 38, item 4); `sent_at` (one
        worker's own clock) only orders its beats."""
        seen = self._workers.get(beat.worker_id)
        if seen is not None and seen.sent_at > beat.sent_at:
            return  # an older beat, read late
        self._workers[beat.worker_id] = _Seen(
            beat.model,
            beat.sent_at,
            heard_at,
            beat.max_model_len,
            beat.capabilities or OLD_WORKER,
        )
        self._first_seen.setdefault(beat.model, heard_at)

    def served(self, now: float) -> dict[str, int]:
        """Model name -> when it was first seen (Unix seconds; a pool's model without a live
        worker: when this directory started), for every live worker's model and every
        model the deployment names (`pooled`)."""
        for worker_id in [w for w, s in self._workers.items() if now - s.last_at > self.stale_s]:
            del self._workers[worker_id]
        live = {s.model for s in self._workers.values()}
        for model in [m for m in self._first_seen if m not in live]:
            del self._first_seen[model]
        served = {m: int(self._first_seen[m]) for m in live}
        for model in self.pooled:
            # A pool's model is served while none of its workers is live (scaled to zero, a
            # worker restarting): its requests are held while one starts (cold_start.py).
            served.setdefault(model, int(self.listening_since))
        for name, route in self.routes.items():
            # A route is served while a model of its cascade is: listed since the first one.
            since = [served[m] for m in route.cascade if m in served]
            if since:
                served[name] = min(since)
        return dict(sorted(served.items()))

    def max_model_len(self, now: float) -> dict[str, int]:
        """Model name -> the context its live workers take (the smallest, where they differ),
        for every served model whose workers say."""
        lengths: dict[str, int] = {}
        for model in self.served(now):
            known = [
                s.max_model_len
                for s in self._workers.values()
                if self._runs(model, s.model) and s.max_model_len is not None
            ]
            if known:
                lengths[model] = min(known)
        return lengths

    def context_length(self, model: str | None, now: float) -> int | None:
        """The smallest context of the live workers that may run a request for `model`
        (None: every live worker, as `capabilities`); None where none says."""
        self.served(now)  # forgets the workers gone quiet
        known = [
            s.max_model_len
            for s in self._workers.values()
            if self._runs(model, s.model) and s.max_model_len is not None
        ]
        return min(known, default=None)

    def capabilities(self, model: str | None, now: float) -> list[Capabilities]:
        """What each live worker that may run a request for `model` honours (None: the
        deployment's default model, which the edge does not know: every live worker)."""
        self.served(now)  # forgets the workers gone quiet
        return [s.capabilities for s in self._workers.values() if self._runs(model, s.model)]

    def _runs(self, model: str | None, worker_model: str) -> bool:
        """Whether a worker of `worker_model` may run a request for `model` (a route: any
        model of its cascade)."""
        route = self.routes.get(model) if model is not None else None
        if route is not None:
            return worker_model in route.cascade
        return model is None or model == worker_model

    def unknown(self, request: ChatRequest, now: float) -> tuple[str, str] | None:
        """(field, message) if the request names a model (or fallback) no live worker
        serves and the deployment does not name (`pooled`); None while this directory is too
        new to say."""
        if now < self.listening_since + self.grace_s:
            return None
        served = self.served(now)
        for field, model in (("model", request.model), ("fallback_model", request.fallback_model)):
            known = served.keys() | self.pooled | self.routes.keys()
            if model is not None and model not in known:
                return field, unknown_model_message(model, served)
        return None
