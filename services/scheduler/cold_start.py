"""Cold models: a request for a model with no live worker is held while one starts, or refused.

Pure: the backlog, the live workers and each model's load time in, refusals out. The
scheduler's steps (steps.py) answer each refusal `overloaded` with its `retry_after_ms`;
every other request of a cold model stays in the backlog (held) until a worker of its
model is live, its plan falls it back, or its deadline expires.

The decision is taken on what the request allowed when it arrived: a request whose deadline
could wait a whole load is held, and is never refused later (one its worker serves too late
ends with `deadline_exceeded`, like any other).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from services.scheduler.backlog import Backlog, Passenger
from services.scheduler.models import ModelLoad, ServingWorker

T = TypeVar("T")


@dataclass(frozen=True)
class Refusal:
    """Why a waiting request is answered `overloaded` now, and when to try again."""

    retry_after_ms: int
    message: str


def cold_refusal(
    model: str, arrived: float, deadline_at: float | None, load_s: float
) -> Refusal | None:
    """None (hold) unless the request's deadline, counted from its arrival, is shorter than
    `model`'s load time; then the refusal, to be tried again once a worker has had that long."""
    if deadline_at is None or deadline_at - arrived >= load_s:
        return None
    retry_after_ms = math.ceil(load_s * 1000.0)
    return Refusal(
        retry_after_ms,
        f"model {model} has no live worker: one takes about {load_s:.1f} s to start, more than"
        f" this request's deadline allows; retry after {retry_after_ms} ms",
    )


@dataclass
class LoadTimes:
    """Each model's load time: the one its newest worker measured, `default_s` before any did.

    Caller: the scheduler's steps (`observe` with each live worker's latest heartbeat).
    Affects: only itself.
    """

    default_s: float
    _measured: dict[str, tuple[float, float]] = field(default_factory=dict)  # started_at, load_s

    def observe(self, model: str, started_at: float, load_s: float | None) -> None:
        """A worker of `model` that started at `started_at` reports its load time (or none)."""
        if load_s is None:
            return
        last = self._measured.get(model)
        if last is None or started_at >= last[0]:
            self._measured[model] = (started_at, load_s)

    def of(self, model: str) -> float:
        measured = self._measured.get(model)
        return self.default_s if measured is None else measured[1]


def refusals(
    backlog: Backlog[T], workers: Sequence[ServingWorker], load_times: LoadTimes
) -> list[tuple[Passenger[T], Refusal]]:
    """The waiting requests of named models with no live worker that cannot wait for one.

    A request whose fallback model has a live worker is left to the plan, which falls it
    back (models.py); a request that names no model runs on any worker and is not counted.
    """
    live: dict[str | None, bool] = {}

    def is_live(model: str | None) -> bool:
        if model not in live:
            live[model] = ModelLoad.of(workers, model).total > 0
        return live[model]

    out: list[tuple[Passenger[T], Refusal]] = []
    for lane in backlog.busy_lanes():
        model = lane.key.model
        if model is None or is_live(model):
            continue
        load_s = load_times.of(model)
        for p in lane:
            if p.fallback is not None and is_live(p.fallback):
                continue
            refusal = cold_refusal(model, p.arrived, p.deadline_at, load_s)
            if refusal is not None:
                out.append((p, refusal))
    return out
