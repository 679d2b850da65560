"""A service's life-long loops fail loudly when they end (unit: plain coroutines, no Kafka).

In an `asyncio.TaskGroup` a child that ends cancelled from within (not by its owner) counts
as done, and the service would run on without it; `shared.process.for_life` turns that, and
a return, into `LoopEnded`, so the group fails and the process exits to be restarted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from shared.process import LoopEnded, for_life


async def forever(started: asyncio.Event) -> None:
    started.set()
    await asyncio.Event().wait()


async def cancelled_from_within() -> None:
    raise asyncio.CancelledError


async def returns() -> None:
    return None


@pytest.mark.parametrize(
    ("loop", "says"),
    [(cancelled_from_within, "was cancelled from within"), (returns, "returned")],
)
async def test_a_loop_that_ends_fails_its_task_group(
    loop: Callable[[], Awaitable[None]], says: str
) -> None:
    started = asyncio.Event()
    sibling: asyncio.Task[None] | None = None

    async def group() -> None:
        nonlocal sibling
        async with asyncio.TaskGroup() as tg:
            sibling = tg.create_task(for_life("sibling", forever(started)))
            tg.create_task(for_life("reader", loop()))

    with pytest.raises(ExceptionGroup) as raised:
        await asyncio.wait_for(group(), 5)
    assert sibling is not None
    [error] = raised.value.exceptions
    assert isinstance(error, LoopEnded)
    assert str(error) == f"reader {says}"
    assert sibling.cancelled()  # the group stopped the rest: nothing runs on half-alive


async def test_a_loop_its_owner_cancels_just_ends() -> None:
    started = asyncio.Event()
    task = asyncio.create_task(for_life("reader", forever(started)))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
