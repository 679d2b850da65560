"""Where every service runs its event loop: uvloop, until SIGINT/SIGTERM, then a clean stop.
SIGUSR1 and SIGUSR2 dump where its tasks and threads wait (shared/stacks.py).

uvloop's loop (libuv, in C) costs less CPU per callback, socket read and timer than the
standard library's; the services are all callbacks, socket reads and timers. Services
served by uvicorn (the edge) pass `UVICORN_LOOP` so they run on the same loop.

The loop is `ServiceLoop`: uvloop's, except that a TLS connection's clean close waits at
most `TLS_CLOSE_TIMEOUT_S` for the peer's close_notify (ADR 0040).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Coroutine
from typing import Any

import uvloop

from shared.stacks import dump_on_signals

# How long closing a TLS connection waits for the peer's close_notify before it drops the
# connection. uvloop's default is 30 s, and a Kafka broker whose response is on its way
# when the client closes does not answer one: a client closed mid-request (SSL, SASL_SSL)
# took that whole wait to stop (ADR 0040). Nothing is lost by dropping it: the response
# would be discarded anyway. A clean close completes in milliseconds, so this leaves a
# loaded machine a wide margin.
TLS_CLOSE_TIMEOUT_S = 1.0


class ServiceLoop(uvloop.Loop):
    """uvloop's loop whose TLS connections wait `TLS_CLOSE_TIMEOUT_S` at most to close,
    unless the caller sets `ssl_shutdown_timeout` itself."""

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("ssl") and kwargs.get("ssl_shutdown_timeout") is None:
            kwargs["ssl_shutdown_timeout"] = TLS_CLOSE_TIMEOUT_S
        return await super().create_connection(*args, **kwargs)


def new_service_loop() -> ServiceLoop:
    """The services' event loop (a loop factory for `asyncio.Runner`, uvloop and uvicorn)."""
    return ServiceLoop()


# uvicorn's `loop` option: an import string naming the loop factory, so the edge runs on
# the same loop as `run_service` gives the other services.
UVICORN_LOOP = "shared.process:new_service_loop"


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on the services' loop; a termination signal cancels it so its `finally`
    blocks close clients."""

    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        dump_on_signals(loop)
        with contextlib.suppress(asyncio.CancelledError):
            await main

    uvloop.run(runner(), loop_factory=new_service_loop)


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
