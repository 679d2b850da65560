"""Acting on the fence (`fence.py`): the epoch every write checks, and what a fencing stops.

Once the worker's heartbeats went unstored long enough for schedulers to declare it dead,
everything running is stopped and handed back, the intake starts a new incarnation, and
batches formed before schedulers could have declared it dead go back unrun.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from services.worker.fence import Fence
from services.worker.intake import BatchIntake
from services.worker.request_state import RunningRequests
from services.worker.settings import WorkerSettings
from shared.messages import Batch

log = structlog.get_logger()


class Liveness:
    """Caller: every writer (`epoch_now`), the heartbeat (`stored`), the batch loop (`stale`).

    Affects: the fence's epoch, the intake's incarnation, the runs (stopped when fenced).
    """

    def __init__(
        self, fence: Fence, intake: BatchIntake, runs: RunningRequests, worker_id: str
    ) -> None:
        self.fence = fence
        self._intake = intake
        self._runs = runs
        self._worker_id = worker_id
        self._epoch = fence.epoch
        # Wall time before which batches sent here may have been handed back by a scheduler
        # that declared us dead: such batches go back too, they are not run here.
        self._stale_before = 0.0
        self._stopping: set[asyncio.Task[None]] = set()

    @classmethod
    def starting(
        cls, settings: WorkerSettings, intake: BatchIntake, runs: RunningRequests
    ) -> Liveness:
        """A worker's liveness as it starts: its fence from the settings, alive from now."""
        interval_s = settings.worker_heartbeat_ms / 1000.0
        fence = Fence(settings.fence_after_beats * interval_s, time.monotonic())
        return cls(fence, intake, runs, settings.worker_id)

    def stored(self, sent_at: float) -> None:
        """A heartbeat sent at `sent_at` (monotonic) is stored."""
        self.fence.stored(sent_at)

    def stale(self, batch: Batch) -> bool:
        """Formed before a scheduler may have declared us dead: it may run it elsewhere."""
        return batch.formed_at < self._stale_before

    def epoch_now(self) -> int:
        """The fence epoch; fences the worker first if its heartbeats went unstored too long."""
        now = time.monotonic()
        silent = self.fence.silent_for(now)
        epoch = self.fence.check(now)
        if epoch != self._epoch:
            self._epoch = epoch
            self._fenced(silent)
        return epoch

    def _fenced(self, silent_s: float) -> None:
        """Schedulers may have declared us dead and re-run our requests: stop all of ours."""
        running = self._runs.ids()
        if not running and len(self._intake) == 0:
            # Nothing of ours can be re-run elsewhere (a broker outage, a slow start): the
            # same incarnation goes on. A batch sent meanwhile runs when read: if it was
            # handed back too, the reset written first hides this run from every reader.
            log.info("worker.silent", worker_id=self._worker_id, silent_s=silent_s)
            return
        # Schedulers could declare us dead `dead_after_s` into the silence, and send us
        # nothing after that until we beat again: what they sent before goes back too.
        silent_since = time.time() - silent_s
        self._stale_before = max(self._stale_before, silent_since + self.fence.dead_after_s)
        log.warning(
            "worker.fenced",
            worker_id=self._worker_id,
            silent_s=round(silent_s, 3),
            epoch=self._epoch,
            running=len(running),
        )
        self._intake.renew()  # heartbeats from now on are a new incarnation's
        if running:
            task = asyncio.get_running_loop().create_task(self._stop_runs(running))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def _stop_runs(self, request_ids: list[str]) -> None:
        # Each run then returns "handed_back" without writing, and its batch hands it back.
        for request_id in request_ids:
            await self._runs.hand_back(request_id)
