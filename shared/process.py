"""Where every service runs its event loop: uvloop, until SIGINT/SIGTERM, then a clean stop.

uvloop's loop (libuv, in C) costs less CPU per callback, socket read and timer than the
standard library's; the services are all callbacks, socket reads and timers. Services
served by uvicorn (the edge) pass `UVICORN_LOOP` so they run on the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Coroutine
from typing import Any, Literal

import uvloop

# uvicorn's `loop` option: the same loop as `run_service` gives the other services.
UVICORN_LOOP: Literal["uvloop"] = "uvloop"


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on uvloop; a termination signal cancels it so its `finally` blocks close
    clients."""

    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await main

    uvloop.run(runner())


class LoopEnded(RuntimeError):
    """A loop meant to run for the process's life ended: it returned, or was cancelled from
    within while nobody cancelled its task."""


async def for_life(name: str, loop: Awaitable[None]) -> None:
    """Await `loop`, a service's loop that runs until the process stops; its end is a failure.

    In a `TaskGroup`, a child that ends cancelled is taken as done, even when the cancel came
    from inside it (a stale waiter's, ADR 0039) and not from its owner: the service would go
    on without it, in silence. Here that, and a return, raise `LoopEnded`, so the group fails
    and the process exits to be restarted, as it does for any other exception.
    """
    try:
        await loop
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # stopping: the owner cancelled it
        raise LoopEnded(f"{name} was cancelled from within") from None
    raise LoopEnded(f"{name} returned")
