"""The scheduler's step: plan (policy.py), carry the plan out (dispatch.py), commit.

Caller: the scheduler app (`run` as a task for the process's life). A step runs when woken
(a fetch, a heartbeat, a worker declared dead), when the plan said it would be due, or at
least every `LONGEST_SLEEP_S`; one step at a time (`lock`), and a rebalance waits for it.

Owner of the commits of the tier consumer: what was handed on (dispatched, answered,
skipped) is committed at most once per commit interval, and at once on revocation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from services.scheduler.admission import Waiting, deadline_error, unserved_error
from services.scheduler.answers import Answerer
from services.scheduler.cold_start import LoadTimes, refusals
from services.scheduler.dispatch import Dispatcher
from services.scheduler.ledger import Ledger
from services.scheduler.models import ModelCheck
from services.scheduler.policy import Plan, Policy, WorkerSlots
from services.scheduler.requeue import Requeue
from services.scheduler.settings import SchedulerSettings
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.workers import WorkerRegistry
from shared.messages import ErrorCode, ErrorResult, unknown_model_message

log = structlog.get_logger()

LONGEST_SLEEP_S = 1.0  # the stepper re-plans at least this often


class Steps:
    """Plans and carries out; hands on and commits what left the tier partitions."""

    def __init__(
        self,
        settings: SchedulerSettings,
        policy: Policy[Waiting],
        workers: WorkerRegistry,
        ledger: Ledger,
        dispatcher: Dispatcher,
        answerer: Answerer,
        telemetry: SchedulerTelemetry,
        tiers: AIOKafkaConsumer,
        wake: asyncio.Event,
        requeue: Requeue,
    ) -> None:
        self.policy = policy
        self.requeue = requeue
        self.workers = workers
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.answerer = answerer
        self.telemetry = telemetry
        # Refuses nothing as unknown until heartbeats have been read a while: replaced
        # when the scheduler starts listening.
        grace_s = settings.scheduler_unknown_model_after_ms / 1000.0
        self.model_check = ModelCheck(time.time(), grace_s)
        self.served_models = frozenset(settings.served_models)
        self.load_times = LoadTimes(settings.scheduler_model_load_s)
        self._tiers = tiers
        self.start_ends: dict[int, int] = {}  # batches partition -> its end when we started
        self._commit_interval = settings.scheduler_commit_interval_ms / 1000.0
        self._wake = wake
        self._wake_at: float | None = None
        # One step (plan, send, commit) at a time; a rebalance waits for the step in flight.
        self.lock = asyncio.Lock()
        self._last_commit = 0.0
        self._handed_on = False  # something was handed on since the last commit

    async def run(self) -> None:
        while True:
            now = time.time()
            sleep = LONGEST_SLEEP_S if self._wake_at is None else self._wake_at - now
            if self._handed_on:  # a commit will be due
                sleep = min(sleep, self._last_commit + self._commit_interval - now)
            if sleep > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(sleep, LONGEST_SLEEP_S)):
                        await self._wake.wait()
            # A step due at once (or a set wake) awaits nothing up to here, and a step that
            # sends nothing awaits nothing either: without this the loop could hold the
            # event loop for good (finding 16), and no rebalance, heartbeat or read ran.
            await asyncio.sleep(0)
            self._wake.clear()
            async with self.lock:
                now = time.time()
                # 1) Plan (after refusing what waits for a model nobody serves, and what
                # cannot wait for a worker of its model to start).
                refused = self._unknown_models(now)
                slots = self.workers.slots(now)
                refused += self._cold_models(now, slots)
                plan = self.policy.plan(now, slots)
                self._wake_at = plan.wake_at
                self.telemetry.waiting_by_model(self._waiting_by_model())
                # 2) Carry it out; 3) commit what it handed on.
                await self._carry_out(plan, now)
                for w, error in refused:
                    await self.answerer.answer(w, error)
                    self.hand_on(w.tp, w.offset)
                for w in await self.requeue.step(now):  # what waits far behind: to the tail
                    self.hand_on(w.tp, w.offset)
                await self.commit()

    def hand_on(self, tp: TopicPartition, offset: int) -> None:
        """The record at `offset` has left this scheduler (dispatched, answered, skipped)."""
        self.ledger.handed_on(tp, offset)
        self._handed_on = True

    def _unknown_models(self, now: float) -> list[tuple[Waiting, ErrorResult]]:
        """Take out every waiting request whose model no known worker serves, with its error."""
        known = self.workers.models() | self.served_models
        backlog = self.policy.backlog
        out: list[tuple[Waiting, ErrorResult]] = []
        for key, lane in list(backlog.lanes.items()):
            model = key.model
            if model is None or not len(lane) or not self.model_check.unknown(model, known, now):
                continue
            message = unknown_model_message(model, known)
            for p in list(lane):
                backlog.remove(p)
                self.telemetry.refused(p.item.request)
                log.info("request.unknown_model", request_id=p.item.request.request_id, model=model)
                error = ErrorResult.for_request(p.item.request, ErrorCode.invalid_request, message)
                out.append((p.item, error))
        return out

    def _waiting_by_model(self) -> Counter[str | None]:
        """Requests left waiting per model after the plan (its dispatches have left)."""
        waiting: Counter[str | None] = Counter()
        for lane in self.policy.backlog.busy_lanes():
            waiting[lane.key.model] += len(lane)
        return waiting

    def _cold_models(
        self, now: float, slots: list[WorkerSlots]
    ) -> list[tuple[Waiting, ErrorResult]]:
        """Take out every waiting request of a model with no live worker whose deadline cannot
        wait for one to start (cold_start.py), with its `overloaded` error."""
        for slot in slots:  # each live worker's latest heartbeat says its load time
            state = self.workers.get(slot.worker_id)
            if state is not None:
                self.load_times.observe(state.beat.model, state.beat.started_at, state.beat.load_s)
        if not self.model_check.settled(now):
            return []  # a live worker may not have been heard yet
        out: list[tuple[Waiting, ErrorResult]] = []
        for p, refusal in refusals(self.policy.backlog, slots, self.load_times):
            request = p.item.request
            self.policy.backlog.remove(p)
            self.telemetry.refused(request)
            log.info(
                "request.cold_model",
                request_id=request.request_id,
                model=p.model,
                retry_after_ms=refusal.retry_after_ms,
            )
            error = ErrorResult.for_request(
                request,
                ErrorCode.overloaded,
                refusal.message,
                retry_after_ms=refusal.retry_after_ms,
            )
            out.append((p.item, error))
        return out

    async def _carry_out(self, plan: Plan[Waiting], now: float) -> None:
        for p in plan.fell_back:
            request = p.item.request
            self.telemetry.fell_back(request, p.model or "")
            log.info(
                "request.fell_back", request_id=request.request_id, model=request.model, to=p.model
            )
        for p, variant in plan.to_baseline:
            self.telemetry.to_baseline(p.model or "", variant)
            log.warning(
                "request.variant_unserved",
                request_id=p.item.request.request_id,
                model=p.model,
                variant=variant,
                to="baseline",
            )
        for out in await self.dispatcher.dispatch(plan.dispatches, now):
            for p in out.dispatch.passengers:
                self.hand_on(p.item.tp, p.item.offset)
        for p in plan.expired:
            w = p.item
            self.telemetry.expired(w.request)
            await self.answerer.answer(w, deadline_error(w.request))
            self.hand_on(w.tp, w.offset)
        for p in plan.unserved:
            w = p.item
            self.telemetry.refused(w.request)
            log.warning(
                "request.unserved",
                request_id=w.request.request_id,
                model=p.model,
                variant=p.variant,
                pinned=p.pinned,
            )
            await self.answerer.answer(w, unserved_error(w.request, p.model, p.variant))
            self.hand_on(w.tp, w.offset)

    async def commit(self, *, only: set[TopicPartition] | None = None) -> None:
        """Commit what moved, at most once per commit interval (and at once on revocation).

        Commits are batched: a crash loses at most an interval of commits, which costs
        nothing but a longer read of the batches topic on restart (see ledger.py).
        """
        now = time.time()
        if only is None and now - self._last_commit < self._commit_interval:
            return
        entries = self.ledger.committable(self._floors())
        if only is not None:
            entries = {tp: e for tp, e in entries.items() if tp in only}
        if not entries:
            if only is None:  # nothing moved since the last commit: none is due
                self._handed_on = False
            return
        try:
            await self._tiers.commit(entries)
        except KafkaError as exc:
            # A rebalance is under way (its revoke callback commits what we hand over), or
            # the broker is away: the next step commits again.
            log.warning("commit.failed", error=repr(exc))
            self._last_commit = now
            return
        self.ledger.mark_committed(entries)
        self._last_commit = now
        self._handed_on = False

    def _floors(self) -> dict[int, int]:
        """Per batches partition, an offset at or below any batch we can still produce."""
        consumed = self.workers.consumed()
        produced = self.dispatcher.last_produced
        return {
            partition: max(start_end, consumed.get(partition, 0), produced.get(partition, -1) + 1)
            for partition, start_end in self.start_ends.items()
        }
