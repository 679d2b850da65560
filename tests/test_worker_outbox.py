"""The result outbox: records put meanwhile leave as one batch, in order; failures reach the writer.

Pure of Kafka: a fake producer stands in, whose batches are stored when the test says so.
A batch Kafka did not take is sent again before anything after it (ADR 0048): a stream on
the log never has a hole.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, NotLeaderForPartitionError
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
            raise KafkaTimeoutError()  # aiokafka: no room behind the partition's batch in time
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.batches.append((topic, partition, batch.values, future))
        return future

    async def partition_for(self, topic: str, key: bytes) -> int:
        return int(key.decode()[-1])  # b"k0" -> 0, b"k1" -> 1

    def stored(self) -> list[bytes]:
        """Values of the batches Kafka stored, in the order they were sent."""
        return [
            v
            for *_, values, f in self.batches
            if f.done() and not f.cancelled() and f.exception() is None
            for v in values
        ]


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
    async with ResultOutbox(producer, resend_s=1.0) as outbox:
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


async def test_a_full_batch_leaves_and_the_rest_follows_once_it_is_stored() -> None:
    producer = FakeProducer(batch_limit=2)
    writer = Writer()
    reply_to = ReplyTo(topic="t.results", partition=0)
    async with ResultOutbox(producer, resend_s=1.0) as outbox:
        for i in range(5):
            outbox.put(reply_to, b"k", str(i).encode(), None, Ticket(writer))
        for sent in range(1, 4):
            await until(lambda sent=sent: len(producer.batches) == sent)  # type: ignore[misc]
            await asyncio.sleep(0.01)
            assert len(producer.batches) == sent  # one batch out at a time
            producer.batches[-1][3].set_result(None)
        await until(lambda: writer.stored == 5)
    assert [v for _, _, v, _ in producer.batches] == [[b"0", b"1"], [b"2", b"3"], [b"4"]]


async def test_a_batch_kafka_did_not_store_is_sent_again_before_anything_after_it() -> None:
    """The broker hang of issue 25: a batch expired in the outage (aiokafka fails it, its
    sequence numbers spent) while later records of the same streams waited behind it. They
    must not be stored before it: the edge would see a hole and end the stream `not_found`."""
    producer = FakeProducer()
    writer = Writer()
    reply_to = ReplyTo(topic="t.results", partition=0)
    run = Ticket(writer)
    async with ResultOutbox(producer, resend_s=5.0) as outbox:
        outbox.put(reply_to, b"k", b"seq0", None, run)
        await until(lambda: len(producer.batches) == 1)
        outbox.put(reply_to, b"k", b"seq1", None, run)  # the stream goes on meanwhile
        outbox.put(reply_to, b"k", b"seq2", None, run)
        await asyncio.sleep(0.01)
        producer.batches[0][3].set_exception(NotLeaderForPartitionError())
        # Whatever is sent next: stored only if everything before it was.
        while len(producer.stored()) < 3:
            count = len(producer.batches)
            await until(lambda count=count: len(producer.batches) > count)  # type: ignore[misc]
            producer.batches[-1][3].set_result(None)
        await until(lambda: writer.stored == 3)
    assert producer.stored() == [b"seq0", b"seq1", b"seq2"]
    assert [v for _, _, v, _ in producer.batches] == [[b"seq0"], [b"seq0"], [b"seq1", b"seq2"]]
    assert writer.errors == []


async def test_a_batch_not_taken_within_the_bound_fails_with_the_rest_of_its_runs() -> None:
    producer = FakeProducer()
    writer = Writer()
    reply_to = ReplyTo(topic="t.results", partition=0)
    async with ResultOutbox(producer, resend_s=5.0) as outbox:
        outbox.put(reply_to, b"k", b"x", None, Ticket(writer))
        producer.fail_sends = 1
        await until(lambda: len(producer.batches) == 1)  # the retry queued it
        producer.batches[0][3].set_result(None)
        await until(lambda: writer.stored == 1)

    # Never taken: its records fail after the bound, and so does every later record of the
    # same run (the run is handed back, its stream ends where it was stored); another
    # run's records go on.
    refusing = FakeProducer(fail_sends=2)  # tries at 0 s and 0.1 s; the bound is then past
    failing, other = Writer(), Writer()
    run = Ticket(failing)
    async with ResultOutbox(refusing, resend_s=0.25) as outbox:
        outbox.put(reply_to, b"k", b"a0", None, run)
        await until(lambda: refusing.fail_sends == 1)
        outbox.put(reply_to, b"k", b"a1", None, run)
        outbox.put(reply_to, b"k", b"b0", None, Ticket(other))
        await until(lambda: len(refusing.batches) == 1)
        refusing.batches[0][3].set_result(None)
        await until(lambda: other.stored == 1)
    assert [v for _, _, v, _ in refusing.batches] == [[b"b0"]]
    assert len(failing.errors) == 2
    assert failing.stored == 0
    assert all(isinstance(e, KafkaTimeoutError) for e in failing.errors)


async def test_records_without_a_partition_go_to_the_partition_of_their_key() -> None:
    producer = FakeProducer()
    writer = Writer()
    topic_only = ReplyTo(topic="t.cache")
    async with ResultOutbox(producer, resend_s=1.0) as outbox:
        for value, key in ((b"x", b"k0"), (b"y", b"k1"), (b"z", b"k0")):
            outbox.put(topic_only, key, value, None, Ticket(writer))
        while writer.stored < 3:  # store each batch as it comes
            await until(lambda: any(not f.done() for *_, f in producer.batches))
            for *_, future in producer.batches:
                if not future.done():
                    future.set_result(None)
            await asyncio.sleep(0.001)
    placed: dict[int, list[bytes]] = {}
    for _, partition, values, _ in producer.batches:
        placed.setdefault(partition, []).extend(values)
    assert placed == {0: [b"x", b"z"], 1: [b"y"]}


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
