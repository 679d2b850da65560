"""The engine's health is the worker's (issue 38, item 2).

A worker whose engine died (vLLM's `AsyncLLM.errored`: its engine core gone) or hangs (it
holds requests and has made no output for `worker_engine_stall_s`) kept its heartbeats,
because they come from the worker's own event loop: every request sent there failed
`internal` one at a time, and since a failed request frees its slot at once, the worker
advertised every slot free and drew more work. Now the watch sees it within a second:
`/readyz` fails, one more heartbeat advertises no free slot, and the process exits
(`EXIT_ENGINE_SICK`) as after a kill -9: the schedulers declare it dead and hand its
requests back to run elsewhere, and its supervisor (`tokenbus up`, Kubernetes) restarts
it. It exits rather than restarting its engine in place: the supervisor's restart is the
one path already proven under faults (the chaos check's kill -9), and a hung engine core
may not let itself be stopped.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

from services.worker.engines.base import Engine, engine_failure

log = structlog.get_logger()

EXIT_ENGINE_SICK = 70  # EX_SOFTWARE
WATCH_EVERY_S = 0.5
# What the last heartbeat may take to be stored before the process goes.
LAST_BEAT_S = 1.0


class HeldWork(Protocol):
    """What the watch reads of the requests running here (`RunningRequests`)."""

    def __len__(self) -> int: ...

    def progress(self) -> tuple[int, float]: ...


def exit_now() -> None:
    """End the process at once, as a kill would, and the engine's processes with it (a
    hung engine core would not stop when asked; an orphan would hold its memory)."""
    for child in multiprocessing.active_children():
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_ENGINE_SICK)


class EngineWatch:
    """Caller: the worker (`run` as a task; `problem` for `/readyz`).

    Affects: nothing until the engine is sick; then `on_sick` (the worker's last heartbeat)
    and the process, which exits.
    """

    def __init__(
        self,
        engine: Engine,
        runs: HeldWork,
        stall_s: float,
        clock: Callable[[], float] = time.monotonic,
        end: Callable[[], None] = exit_now,
    ) -> None:
        self._engine = engine
        self._runs = runs
        self._stall_s = stall_s
        self._clock = clock
        self._end = end  # the process's (a test's own in unit tests)
        self.sick: str | None = None  # why, once seen

    def problem(self) -> str | None:
        """Why the engine cannot serve now; None while it is healthy."""
        if (why := engine_failure(self._engine)) is not None:
            return f"the engine died: {why}"
        held, progressed_at = self._runs.progress()
        silent = self._clock() - progressed_at
        if held and silent > self._stall_s:
            return (
                f"the engine made no output for {silent:.0f} s while it held {held}"
                f" requests (worker_engine_stall_s {self._stall_s:g})"
            )
        return None

    async def run(self, on_sick: Callable[[], Awaitable[None]]) -> None:
        """Watch until the engine is sick; then tell the schedulers and exit."""
        why = self.problem()
        while why is None:  # polled: death and silence are states, not events
            await asyncio.sleep(WATCH_EVERY_S)
            why = self.problem()
        self.sick = why
        log.error("engine.sick", why=why, running=len(self._runs))
        try:
            async with asyncio.timeout(LAST_BEAT_S):
                await on_sick()
        except Exception as exc:
            log.warning("engine.sick_last_beat_failed", error=repr(exc))
        self._end()
