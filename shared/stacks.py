"""Where a running service is stuck: its tasks' coroutine chains on SIGUSR1, its threads'
stacks on SIGUSR2.

A service that stops making progress without an error (a read that waits for an answer
that never comes) shows nothing in its log. `kill -USR1 <pid>` logs one `task.stack`
line per asyncio task, naming each frame it waits in, innermost last; the process goes
on. If the event loop itself is blocked (a loop that never yields), that never runs:
`kill -USR2 <pid>` has `faulthandler` write every thread's Python stack to stderr from
the signal handler itself. The chaos check sends both to every service when a run fails.
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import structlog

log = structlog.get_logger()


def _frames(coro: Any) -> Iterator[FrameType]:
    """The frames of a coroutine chain, outermost first, down to what it awaits."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        frame = frame or getattr(coro, "ag_frame", None)
        if frame is not None:
            yield frame
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )


def task_stacks() -> list[tuple[str, list[str]]]:
    """Every task of the running loop: its name and the frames it waits in."""
    out = []
    for task in asyncio.all_tasks():
        frames = [
            f"{f.f_code.co_filename.rsplit('/site-packages/', 1)[-1]}:{f.f_lineno} "
            f"{f.f_code.co_name}"
            for f in _frames(task.get_coro())
        ]
        out.append((task.get_name(), frames))
    return out


def dump() -> None:
    """Log where every task waits (one `task.stack` line each)."""
    stacks = task_stacks()
    for name, frames in sorted(stacks):
        log.warning("task.stack", task=name, frames=" <- ".join(reversed(frames)))
    log.warning("task.stacks_dumped", tasks=len(stacks))


def dump_on_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Dump every task's stack on SIGUSR1, every thread's on SIGUSR2."""
    loop.add_signal_handler(signal.SIGUSR1, dump)
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
