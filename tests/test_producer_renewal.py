"""A producer whose idempotent sequence broke (aiokafka#1017) is replaced (fake producers)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka.errors import OutOfOrderSequenceNumber

from shared.producers import RenewingProducer


class FakeProducer:
    """Stores what it is sent; once `broken`, every write fails as aiokafka's does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: list[bytes] = []
        self.broken = False
        self.started = False
        self.stopped = False
        self.client = f"client-of-{name}"

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def send(self, topic: str, value: bytes, **kwargs: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.broken:
            future.set_exception(OutOfOrderSequenceNumber())
        else:
            self.sent.append(value)
            future.set_result(len(self.sent))
        return future


async def test_a_broken_producer_is_replaced_and_writes_go_on() -> None:
    made: list[FakeProducer] = []

    def make() -> Any:
        made.append(FakeProducer(f"p{len(made)}"))
        return made[-1]

    producer = RenewingProducer(make)
    await producer.start()
    assert await producer.send_and_wait("t", b"one") == 1
    made[0].broken = True  # a broker outage left a gap in its sequence numbers
    futures = [await producer.send("t", b"lost") for _ in range(3)]  # failing at once
    await asyncio.wait(futures)
    await producer.settled()
    assert producer.renewals == 1
    assert len(made) == 2
    assert made[0].stopped
    assert made[1].started
    assert producer.client == "client-of-p1"
    assert await producer.send_and_wait("t", b"two") == 1  # on the new producer
    assert made[1].sent == [b"two"]
    await producer.stop()
