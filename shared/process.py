"""Running a service's main coroutine until SIGINT/SIGTERM, then shutting it down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run `main`; a termination signal cancels it so its `finally` blocks close clients."""

    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await main

    asyncio.run(runner())
