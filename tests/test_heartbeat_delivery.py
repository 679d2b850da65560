"""A beat whose producer waits (for its metadata, on a node that hangs) holds back no other
partition's beat (stop 18's clean clone: a worker in its first second was declared dead when
a node hung, its heartbeat loop waiting in one young producer's `send`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from pydantic import BaseModel

from services.worker.heartbeat import Heartbeats
from services.worker.settings import WorkerSettings
from shared.messages import LEAVING_HEADER


class FakeProducer:
    """`send` queues at once and the record is stored at once; or, `hangs`, never returns."""

    def __init__(self, *, hangs: bool = False) -> None:
        self.hangs = hangs
        self.sent = 0

    async def send(self, topic: str, value: bytes, **_: Any) -> asyncio.Future[None]:
        self.sent += 1
        if self.hangs:
            await asyncio.Event().wait()
        stored: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        stored.set_result(None)
        return stored


class FakeBeatProducers:
    def __init__(self, producers: dict[int, FakeProducer]) -> None:
        self.by_partition = producers


class FakeLiveness:
    def __init__(self) -> None:
        self.stored_at: list[float] = []

    def epoch_now(self) -> int:
        return 0

    def stored(self, sent_at: float) -> None:
        self.stored_at.append(sent_at)


class Beat(BaseModel):
    worker_id: str = "w"


class FakeBeatHeartbeats(Heartbeats):
    """The real sending, with a fixed beat (what a beat says is tested elsewhere)."""

    def _beat(self) -> Any:
        return Beat()


def heartbeats(producers: dict[int, FakeProducer], liveness: FakeLiveness) -> Heartbeats:
    none = cast(Any, None)
    return FakeBeatHeartbeats(
        WorkerSettings(worker_id="w"),
        cast(Any, FakeBeatProducers(producers)),
        none,
        none,
        cast(Any, liveness),
        none,
        none,
    )


async def until(condition: Any, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.01)


async def test_a_send_that_waits_holds_back_no_other_partition() -> None:
    waiting, others = FakeProducer(hangs=True), [FakeProducer(), FakeProducer()]
    liveness = FakeLiveness()
    beats = heartbeats({0: waiting, 1: others[0], 2: others[1]}, liveness)
    async with asyncio.timeout(1.0):
        await beats.send()  # returns without waiting on any partition
    await until(lambda: len(liveness.stored_at) == 2)  # stored on partitions 1 and 2
    assert [p.sent for p in (waiting, *others)] == [1, 1, 1]

    # The next beat: partition 0's last one is still on its way, so it gets none more.
    async with asyncio.timeout(1.0):
        await beats.send()
    await until(lambda: len(liveness.stored_at) == 4)
    assert [p.sent for p in (waiting, *others)] == [1, 2, 2]


class SlowProducer(FakeProducer):
    """`send` queues at once; the record is stored `store_s` later; headers are kept."""

    def __init__(self, store_s: float) -> None:
        super().__init__()
        self.store_s = store_s
        self.headers: list[Any] = []

    async def send(self, topic: str, value: bytes, **options: Any) -> asyncio.Future[None]:
        self.sent += 1
        self.headers.append(options.get("headers"))
        stored: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(self.store_s, stored.set_result, None)
        return stored


async def test_the_leaving_beat_goes_to_every_partition_even_behind_an_unsettled_beat() -> None:
    """make upgrade-check (stop 58): a drained worker's leaving beat went nowhere while its
    last ordinary beats were still on their way (each partition holds back a beat behind an
    unsettled one), and the schedulers took it for dead after its silence."""
    producers = {p: SlowProducer(store_s=0.2) for p in (0, 1, 2)}
    beats = heartbeats(cast(Any, producers), FakeLiveness())
    await beats.send()  # ordinary beats, unsettled for 0.2 s
    await beats.leave()
    for producer in producers.values():
        assert producer.headers[0] is None
        assert producer.headers[-1] == [(LEAVING_HEADER, b"1")], producer.headers
