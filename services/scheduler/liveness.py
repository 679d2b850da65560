"""The liveness watch: declares workers dead and, on the scheduler that leads recovery,
hands their unfinished requests back (recovery.py)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from aiokafka.errors import KafkaError

from services.scheduler.recovery import Recovery
from services.scheduler.workers import WorkerRegistry
from shared.messages import Heartbeat

log = structlog.get_logger()

LIVENESS_TICK_S = 0.1
RESWEEP_AFTER_S = 10.0  # a dead worker is swept once more, for batches sent in a race
RECOVERY_MEMORY_S = 600.0  # a recovery not led here is forgotten after this
FORGET_DEAD_AFTER_S = 120.0  # a dead worker not recovered here is forgotten after this
# Longest one recovery may take: its settle (15 s) and finals read (10 s) with room to spare.
RECOVERY_TIMEOUT_S = 45.0


@dataclass
class PendingRecovery:
    beat: Heartbeat
    due_at: float
    sweep: bool = False


class Liveness:
    """Caller: one task of the scheduler. Affects: the worker registry's dead workers."""

    def __init__(
        self,
        grace_s: float,
        workers: WorkerRegistry,
        recovery: Recovery,
        leads_recovery: Callable[[], bool],
        wake: asyncio.Event,
    ) -> None:
        self._grace_s = grace_s
        self._workers = workers
        self._recovery = recovery
        self._leads_recovery = leads_recovery
        self._wake = wake
        self._recoveries: dict[str, PendingRecovery] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(LIVENESS_TICK_S)
            now = time.time()
            for state in self._workers.newly_dead(now):
                # A drained worker says it leaves; its recovery only finds what it was sent
                # after its last beat (usually nothing).
                (log.info if state.leaving else log.warning)(
                    "worker.left" if state.leaving else "worker.dead",
                    worker_id=state.beat.worker_id,
                    silent_s=round(now - state.seen_at, 3),
                    held=len(state.beat.held),
                )
                self._recoveries[state.beat.worker_id] = PendingRecovery(
                    state.beat, now + self._grace_s
                )
                self._wake.set()
            leader = self._leads_recovery()
            if self._recoveries and leader:
                await self._recover_due(now)
            for worker_id, pending in list(self._recoveries.items()):
                if now - pending.due_at > RECOVERY_MEMORY_S:
                    del self._recoveries[worker_id]  # the leader elsewhere has done it
            # The leader forgets a worker once recovered; the others after a while.
            keep = set(self._recoveries) if leader else set()
            for worker_id in self._workers.forget_dead(now, FORGET_DEAD_AFTER_S, keep):
                log.info("worker.forgotten", worker_id=worker_id, registered=len(self._workers))

    async def _recover_due(self, now: float) -> None:
        for worker_id, pending in list(self._recoveries.items()):
            if pending.due_at > now:
                continue
            state = self._workers.get(worker_id)
            if state is not None and state.dead_at is None:
                del self._recoveries[worker_id]  # it beat again before the grace ran out
                continue
            done = set() if state is None else state.handed_back
            try:
                # Bounded: a step waiting on an away coordinator is cut and the whole recovery
                # tried again (it is redone from the start, never half-counted: recovery.py).
                async with asyncio.timeout(RECOVERY_TIMEOUT_S):
                    handed = await self._recovery.recover(
                        pending.beat, done, functools.partial(self._still_dead, pending.beat)
                    )
            except (KafkaError, TimeoutError) as exc:
                log.error("worker.recovery_failed", worker_id=worker_id, error=repr(exc))
                pending.due_at = now + 1.0
                continue
            done.update(handed)
            if pending.sweep:
                del self._recoveries[worker_id]
                # Recovered twice over: nothing of it is left here. If it comes back, it
                # registers afresh (its copies of what was handed back are dropped at intake).
                if self._workers.forget(worker_id):
                    log.info("worker.forgotten", worker_id=worker_id, registered=len(self._workers))
            else:
                pending.due_at, pending.sweep = now + RESWEEP_AFTER_S, True

    def _still_dead(self, last: Heartbeat) -> bool:
        """Whether the incarnation that sent `last` is still the dead one we know."""
        state = self._workers.get(last.worker_id)
        if state is None:
            return True  # forgotten: nothing of it came back
        return state.dead_at is not None and state.beat.started_at == last.started_at
