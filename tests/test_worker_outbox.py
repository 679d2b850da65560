"""The result outbox: records put meanwhile leave as one batch, in order; failures reach the writer.

Pure of Kafka: a fake producer stands in, whose batches are stored when the test says so.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.worker.engines.base import EngineRequest
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_profiles import sim_profile
from services.worker.outbox import ResultOutbox
from services.worker.telemetry import WorkerTelemetry
from shared.messages import ReplyTo
from shared.metrics import WorkerMetrics


class FakeBatch:
    def __init__(self, limit: int) -> None:
        self.values: list[bytes] = []
        self.limit = limit

    def append(self, *, key: bytes, value: bytes, timestamp: None, headers: Any) -> object:
        if len(self.values) >= self.limit:
            return None
        self.values.append(value)
        return object()


class FakeProducer:
    """Keeps every batch sent with its future; `fail_sends` refuses to queue that many."""

    def __init__(self, batch_limit: int = 100, fail_sends: int = 0) -> None:
        self.batches: list[tuple[str, int, list[bytes], asyncio.Future[Any]]] = []
        self.batch_limit = batch_limit
        self.fail_sends = fail_sends

    def create_batch(self) -> FakeBatch:
        return FakeBatch(self.batch_limit)

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        if self.fail_sends:
            self.fail_sends -= 1
            raise TimeoutError("no metadata")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.batches.append((topic, partition, batch.values, future))
        return future

    async def send(self, topic: str, value: bytes, **kwargs: Any) -> Any:
        raise AssertionError("every record here has a partition")


class Writer:
    """A ticket that counts what it was told."""

    def __init__(self) -> None:
        self.stored = 0
        self.errors: list[BaseException] = []

    def stored_one(self) -> None:
        self.stored += 1

    def failed(self, error: BaseException) -> None:
        self.errors.append(error)


class Ticket:
    def __init__(self, writer: Writer) -> None:
        self._writer = writer

    def stored(self) -> None:
        self._writer.stored_one()

    def failed(self, error: BaseException) -> None:
        self._writer.failed(error)


async def until(predicate: Any, timeout: float = 5.0) -> None:
    """Poll the loop until `predicate` holds (the outbox's lanes run as tasks)."""
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 - the state polled has no event of its own
            await asyncio.sleep(0.001)


async def test_records_put_together_leave_as_one_batch_per_partition_in_order() -> None:
    producer = FakeProducer()
    writer = Writer()
    a, b = ReplyTo(topic="t.results", partition=0), ReplyTo(topic="t.results", partition=1)
    async with ResultOutbox(producer, within_s=1.0) as outbox:
        for i in range(5):
            outbox.put(a, b"k", f"a{i}".encode(), None, Ticket(writer))
        outbox.put(b, b"k", b"b0", None, Ticket(writer))
        await until(lambda: len(producer.batches) == 2)
        by_partition = {p: values for _, p, values, _ in producer.batches}
        assert by_partition == {0: [b"a0", b"a1", b"a2", b"a3", b"a4"], 1: [b"b0"]}
        assert writer.stored == 0  # not before Kafka says so
        for *_, future in producer.batches:
            future.set_result(None)
        await until(lambda: writer.stored == 6)
    assert writer.errors == []


async def test_a_full_batch_leaves_and_the_rest_follows_in_the_next() -> None:
    producer = FakeProducer(batch_limit=2)
    writer = Writer()
    reply_to = ReplyTo(topic="t.results", partition=0)
    async with ResultOutbox(producer, within_s=1.0) as outbox:
        for i in range(5):
            outbox.put(reply_to, b"k", str(i).encode(), None, Ticket(writer))
        await until(lambda: sum(len(v) for _, _, v, _ in producer.batches) == 5)
    assert [v for _, _, v, _ in producer.batches] == [[b"0", b"1"], [b"2", b"3"], [b"4"]]


async def test_a_batch_kafka_refuses_fails_each_of_its_records() -> None:
    producer = FakeProducer()
    writer = Writer()
    reply_to = ReplyTo(topic="t.results", partition=0)
    async with ResultOutbox(producer, within_s=1.0) as outbox:
        outbox.put(reply_to, b"k", b"x", None, Ticket(writer))
        outbox.put(reply_to, b"k", b"y", None, Ticket(writer))
        await until(lambda: len(producer.batches) == 1)
        producer.batches[0][3].set_exception(TimeoutError("not stored"))
        await until(lambda: len(writer.errors) == 2)
    assert writer.stored == 0


async def test_a_batch_that_cannot_be_queued_is_retried_then_its_records_fail() -> None:
    producer = FakeProducer(fail_sends=1)
    writer = Writer()
    reply_to = ReplyTo(topic="t.results", partition=0)
    async with ResultOutbox(producer, within_s=5.0) as outbox:
        outbox.put(reply_to, b"k", b"x", None, Ticket(writer))
        await until(lambda: len(producer.batches) == 1)  # the retry queued it
        producer.batches[0][3].set_result(None)
        await until(lambda: writer.stored == 1)

    refusing = FakeProducer(fail_sends=100)
    async with ResultOutbox(refusing, within_s=0.2) as outbox:
        outbox.put(reply_to, b"k", b"x", None, Ticket(writer))
        await until(lambda: len(writer.errors) == 1)
    assert isinstance(writer.errors[0], TimeoutError)


async def test_the_sim_engine_counts_its_own_cpu_time_into_the_engine_counter() -> None:
    engine = SimEngine(sim_profile("constant", max_num_seqs=4, token_rate=2000.0))
    await engine.start()
    try:
        request = EngineRequest(request_id="r1", prompt="tell me a story", max_tokens=64)
        outputs = [out async for out in engine.generate(request)]
    finally:
        await engine.stop()
    assert outputs
    assert engine.cpu_seconds > 0.0
    registry = CollectorRegistry()
    telemetry = WorkerTelemetry(WorkerMetrics.build(registry), recording=False)
    telemetry.observe_engine_cpu(engine.cpu_seconds)
    telemetry.observe_engine_cpu(engine.cpu_seconds)  # cumulative: counted once
    counted = registry.get_sample_value("tokenbus_worker_engine_cpu_seconds_total")
    assert counted == pytest.approx(engine.cpu_seconds)
