"""A route's answer that fails its verifier goes on to the cascade's next model (ADR 0059).

Caller: the runner, when a run of a route's request (`QueuedRequest.cascade_step` set, a
model after it in the cascade) has streamed its whole answer and before its final record.
`decide` judges the answer with the route's verifiers (verifiers.py); on a failure the run
does not answer. A run the engine failed (`failed`: an `internal` error, as a crashed
generation gives) goes on to the next model the same way, rather than ending in an error
the next model may well not make. `escalate`, in order:

1. waits until the answer's deltas are stored, and writes a `reset` of the next attempt to
   `reply_to` (the client drops what it was shown and waits for the next model);
2. writes the request as its next attempt (`QueuedRequest.next_attempt`), its step raised
   to the next model's, to its tier topic, and waits until it is stored.

Only then does the run end (the worker holds the request in its heartbeats until it
ends). If the worker dies before step 2 is stored, the scheduler's recovery re-runs the
request from its batch (on the same model: it refuses again and escalates); if it dies
after, the recovery's copy of the same attempt is dropped by the scheduler as a second
hand-back. A write that fails hands the request back as any failed run is. Either way the
request runs on until one model answers it, once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from prometheus_client import Counter

from services.worker.engines.base import EngineFinish
from services.worker.outbox import ResultOutbox
from services.worker.replies import ReplyWriter
from services.worker.request_state import RequestState
from services.worker.settings import WorkerSettings
from services.worker.telemetry import RunTrace
from services.worker.verifiers import Answer, judge, unjudged
from shared import semconv
from shared.cascades import Route, Routes
from shared.kafka import encode
from shared.messages import ErrorCode, ErrorResult, QueuedRequest, ReplyTo, ResetResult, Usage
from shared.topics import Topics

log = structlog.get_logger()


@dataclass(frozen=True)
class Escalation:
    """A route's answer failed a verifier: the request goes on to `to_model`."""

    route: str
    from_model: str
    to_model: str
    reason: str  # the kind of the verifier it failed
    next_attempt: QueuedRequest  # what is written to the tier topic
    # What the declined attempt used, where known: its reset carries it, and the edge
    # charges the tenant for it beside the final answer's (issue 37, N5).
    used: Usage | None = None


def route_ahead(routes: Routes, request: QueuedRequest) -> Route | None:
    """The request's route, if a model of its cascade comes after the one running it."""
    route = routes.get(request.model) if request.model is not None else None
    step = request.cascade_step
    if route is None or step is None or step + 1 >= len(route.cascade):
        return None
    return route


# The reason an escalation gives when the engine failed the run (no verifier's kind).
ENGINE_ERROR = "engine_error"


def onwards(
    routes: Routes, request: QueuedRequest, reason: str, used: Usage | None = None
) -> Escalation | None:
    """The request handed on to its route's next model for `reason` (its attempt having
    used `used`); None where no model of its cascade comes after the one running it."""
    route = route_ahead(routes, request)
    if route is None or request.cascade_step is None or request.model is None:
        return None
    step = request.cascade_step
    # The next model answers anew: it continues nothing of the answer it replaces.
    raised = request.model_copy(update={"cascade_step": step + 1, "continues": None})
    return Escalation(
        route=request.model,
        from_model=route.model_at(step),
        to_model=route.model_at(step + 1),
        reason=reason,
        next_attempt=raised.next_attempt(),
        used=used,
    )


@functools.cache
def escalations_counter() -> Counter:
    """One per process, on the default registry (as shared/metrics.py's sets are)."""
    return Counter(
        "tokenbus_worker_cascade_escalations",
        "Answers of a route's model that failed its verifier, handed on to the cascade's next"
        " model (reason: the verifier's kind, or engine_error where the engine failed the run).",
        ["route", "from_model", "reason"],
    )


class Cascade:
    """Caller: the runner (`watches` at a run's start, `decide` and `escalate` at its end).

    Affects: nothing of its own; it writes through the worker's result outbox.
    """

    def __init__(
        self,
        routes: Routes,
        topics: Topics,
        outbox: ResultOutbox,
        epoch_now: Callable[[], int],
        within_s: float,
    ) -> None:
        self._routes = dict(routes)
        self._topics = topics
        self._outbox = outbox
        self._epoch_now = epoch_now
        self._within_s = within_s

    @classmethod
    def of(
        cls, settings: WorkerSettings, outbox: ResultOutbox, epoch_now: Callable[[], int]
    ) -> Cascade | None:
        """The worker's cascade; None where no route is configured."""
        if not settings.routes:
            return None
        topics = Topics(settings.topic_prefix)
        within = settings.worker_result_write_timeout_s
        return cls(settings.routes, topics, outbox, epoch_now, within)

    def watches(self, request: QueuedRequest) -> bool:
        """Whether the run must keep its answer for `decide` (a later model may take it)."""
        return route_ahead(self._routes, request) is not None

    async def decide(self, state: RequestState, finish: EngineFinish | None) -> Escalation | None:
        """Judge a finished answer (all of it flushed to the state), off the event loop
        (`verifiers.judge`); None: it answers."""
        if finish is None or finish.finish_reason == "cancelled" or not state.keep_answer:
            return None
        answer = Answer(
            text="".join(state.chunks),
            completion_tokens=finish.completion_tokens,
            logprobs=state.logprobs or None,
        )
        route = route_ahead(self._routes, state.request)
        if route is None:
            return None
        if unjudged(route.verifiers, answer):
            log.info("cascade.unjudged", request_id=state.request_id, why="no logprobs")
        reason = await judge(route.verifiers, answer)
        if reason is None:
            return None
        used = Usage(prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens)
        return onwards(self._routes, state.request, reason, used)

    def failed(self, state: RequestState, failure: ErrorResult) -> Escalation | None:
        """A run the engine failed (`internal`) goes on to the next model; None: it ends
        in `failure` (no model after this one, or another error: a request the next model
        would refuse as well)."""
        if failure.code != ErrorCode.internal:
            return None
        return onwards(self._routes, state.request, ENGINE_ERROR, failure.usage)

    async def escalate(self, state: RequestState, up: Escalation, trace: RunTrace) -> None:
        """Hand the request on to the next model (the module's steps 1 and 2); return once
        both writes are stored. Raises `Fenced` or `ReplyFailed` as a run's writes do."""
        request = state.request
        state.writer.send(ResetResult.before_retry(request, f"escalated: {up.reason}", up.used))
        await state.writer.flush()
        tier = ReplyWriter(
            self._outbox,
            ReplyTo(topic=self._topics.tier(request.tier)),
            request.request_id,
            epoch=self._epoch_now(),
            epoch_now=self._epoch_now,
            within_s=self._within_s,
        )
        state.writer.check()  # fenced since the run began: no escalation, the run re-runs
        tier.send_encoded(encode(up.next_attempt))
        await tier.flush()
        escalations_counter().labels(up.route, up.from_model, up.reason).inc()
        if trace.span is not None:
            trace.span.set_attributes(
                {semconv.CASCADE_ESCALATED_TO: up.to_model, semconv.CASCADE_REASON: up.reason}
            )
        log.info(
            "cascade.escalated",
            request_id=request.request_id,
            attempt=up.next_attempt.attempt,
            route=up.route,
            from_model=up.from_model,
            to_model=up.to_model,
            reason=up.reason,
        )
