"""A recovery whose transactional producer cannot start is a Kafka error the scheduler
retries, never the end of the scheduler (stop 18's clean clone: aiokafka's
"Did we not perform bootstrap?" assertion, just after the only broker's hang)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaError

from services.scheduler import recovery
from services.scheduler.recovery import Recovery, start_fencing
from shared.messages import Heartbeat
from shared.settings import TokenbusSettings


class FakeProducer:
    """Starts as aiokafka's does when its metadata names no broker."""

    def __init__(self) -> None:
        self.stopped = False

    async def start(self) -> None:
        raise AssertionError("Did we not perform bootstrap?")

    async def stop(self) -> None:
        self.stopped = True


async def test_a_start_that_finds_no_broker_is_a_kafka_error() -> None:
    with pytest.raises(KafkaConnectionError, match="no broker known"):
        await start_fencing(cast(Any, FakeProducer()))


async def test_the_failed_recovery_closes_its_producer_and_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[FakeProducer] = []

    def make_producer(*args: Any, **kwargs: Any) -> FakeProducer:
        made.append(FakeProducer())
        return made[-1]

    monkeypatch.setattr(recovery, "make_producer", make_producer)
    r = Recovery(
        TokenbusSettings(), cast(Any, None), cast(Any, None), cast(Any, None), asyncio.Lock()
    )
    beat = Heartbeat(
        worker_id="w",
        model="m",
        total_slots=1,
        free_slots=1,
        running=0,
        queued_tokens=0,
        utilisation=0.0,
        batch_partition=0,
    )
    # KafkaError is what the scheduler's liveness loop catches and retries a second later.
    with pytest.raises(KafkaError):
        await r.recover(beat)
    assert [p.stopped for p in made] == [True]
