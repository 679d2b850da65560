"""When a lane's bus leaves: the fixed bus rule, and the adaptive rule built on a cost model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from services.scheduler.backlog import Lane

DispatchReason = Literal["full", "tokens", "timeout", "deadline", "adaptive"]
DISPATCH_REASONS: tuple[DispatchReason, ...] = ("full", "tokens", "timeout", "deadline", "adaptive")


class DepartureRule(Protocol):
    """Decides whether a lane's batch leaves now; `load` is the workers' busy fraction."""

    name: str

    def reason(self, lane: Lane[Any], now: float, load: float) -> DispatchReason | None: ...

    def due_at(self, lane: Lane[Any], now: float, load: float) -> float:
        """When `reason` turns non-None if nothing arrives meanwhile."""
        ...


def bus_rule(lane: Lane[Any], now: float) -> DispatchReason | None:
    """Full by count, full by tokens, a deadline that would pass first, or waited enough."""
    limits = lane.limits
    if len(lane) >= limits.max_batch_size:
        return "full"
    if lane.tokens >= limits.max_batch_tokens:
        return "tokens"
    head = lane.head()
    leaves_at = head.arrived + limits.max_wait_ms / 1000.0
    if now >= leaves_at:
        return "timeout"
    deadline = lane.earliest_deadline()
    if deadline is not None and deadline <= leaves_at:
        return "deadline"  # waiting for the bus would outlive a passenger's deadline
    return None


class FixedRule:
    """Triton-style: leave when full (count or tokens) or when the oldest waited max_wait."""

    name = "fixed"

    def reason(self, lane: Lane[Any], now: float, load: float) -> DispatchReason | None:
        return bus_rule(lane, now)

    def due_at(self, lane: Lane[Any], now: float, load: float) -> float:
        return lane.head().arrived + lane.limits.max_wait_ms / 1000.0


@dataclass(frozen=True)
class CostModel:
    """Engine time of one batch of `n` requests: `per_request_s * n + per_batch_s`.

    BentoML fits the same line to measured batch latencies. For a continuous-batching
    LLM engine, `per_batch_s` is what admitting a batch costs the sequences already running
    (one more step that is not pure decode), `per_request_s` the prefill of one request.
    """

    per_request_s: float
    per_batch_s: float


def fit_cost_model(samples: Sequence[tuple[int, float]], prior: CostModel) -> CostModel:
    """Least-squares line through (batch size, seconds) samples; `prior` when underdetermined.

    Clamped like BentoML's optimizer: the slope stays positive and the intercept non-negative.
    """
    if len({n for n, _ in samples}) < 2:
        return prior
    count = len(samples)
    mean_n = sum(n for n, _ in samples) / count
    mean_s = sum(s for _, s in samples) / count
    var_n = sum((n - mean_n) ** 2 for n, _ in samples)
    cov = sum((n - mean_n) * (s - mean_s) for n, s in samples)
    slope = max(1e-6, cov / var_n)
    intercept = max(0.0, mean_s - slope * mean_n)
    return CostModel(slope, intercept)


class AdaptiveRule:
    """Wait only while the passengers expected to join pay for the delay, up to max_wait.

    Waiting `dt` more costs the `n` passengers `n * dt` of latency. It brings
    `rate * dt` newcomers, each of whom saves the engine one batch overhead `per_batch_s`
    but adds `per_request_s` to the batch the `n` others ride in. Engine time saved only
    shortens anyone's wait while the engine is busy, so the saving is weighted by `load`
    (the busy fraction of the workers' slots). The bus leaves as soon as

        load * rate * (per_batch_s - n * per_request_s) <= n

    and in any case when the fixed bus rule says so (full, tokens, deadline, max_wait).
    An idle pipeline therefore sends each request at once; a busy one grows its batches.
    """

    name = "adaptive"

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def reason(self, lane: Lane[Any], now: float, load: float) -> DispatchReason | None:
        fixed = bus_rule(lane, now)
        if fixed is not None:
            return fixed
        if now >= self._adaptive_at(lane, load):
            return "adaptive"
        return None

    def due_at(self, lane: Lane[Any], now: float, load: float) -> float:
        timeout = lane.head().arrived + lane.limits.max_wait_ms / 1000.0
        return min(timeout, self._adaptive_at(lane, load))

    def _adaptive_at(self, lane: Lane[Any], load: float) -> float:
        """The time from which waiting no longer pays, if nobody else arrives."""
        n = len(lane)
        saving = load * (self.cost.per_batch_s - n * self.cost.per_request_s)
        assert lane.last_arrival is not None  # a lane with passengers has seen an arrival
        if saving <= 0:
            return lane.last_arrival
        # rate = 1 / max(mean_gap, now - last_arrival): it pays to wait while rate > n / saving.
        if lane.mean_gap is not None and lane.mean_gap * n >= saving:
            return lane.last_arrival
        return lane.last_arrival + saving / n
