"""The edge's result reader loop: changes of what it follows never stop it (unit, fakes).

The chaos check once lost 608 acknowledged requests to an edge whose reader had ended
without a word: a follow/unfollow asked for while a fetch was being handed over (a stream
ending, a resume) left a stale wake-up that cancelled the next fetch, and the reader took
that cancel for its own and raised CancelledError, which its supervisor does not restart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from aiokafka import ConsumerRecord, TopicPartition
from pydantic import TypeAdapter

from services.edge import results as results_module
from services.edge.results import ResultReader
from shared.messages import DeltaResult, DoneResult, ResultRecord, Timings, Usage
from shared.records import read
from tests.factories import consumer_record

CONTROL = TopicPartition("t.control", 0)
OWN = TopicPartition("t.results", 0)
FOREIGN = TopicPartition("t.results", 1)


class FakeConsumer:
    """The part of AIOKafkaConsumer the reader uses; records are queued by the test."""

    def __init__(self) -> None:
        self.assigned: list[TopicPartition] = []
        self.positions: dict[TopicPartition, int] = {}
        self.logs: dict[TopicPartition, list[tuple[bytes | None, bytes]]] = {}
        self.arrived = asyncio.Event()
        self.fetches = 0

    def assign(self, tps: list[TopicPartition]) -> None:
        self.assigned = list(tps)
        self.positions = {}

    async def seek_to_end(self, tp: TopicPartition) -> None:
        self.positions[tp] = len(self.logs.setdefault(tp, []))

    async def position(self, tp: TopicPartition) -> int:
        return self.positions[tp]

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp] = offset

    def append(self, tp: TopicPartition, value: bytes, key: bytes | None = None) -> None:
        self.logs.setdefault(tp, []).append((key, value))
        self.arrived.set()

    async def getmany(
        self, timeout_ms: int, max_records: int
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        self.fetches += 1
        while True:
            out: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {}
            for tp in self.assigned:
                log = self.logs.get(tp, [])
                start = self.positions.get(tp, len(log))
                if start < len(log):
                    out[tp] = [
                        consumer_record(
                            tp.topic,
                            log[off][1],
                            partition=tp.partition,
                            offset=off,
                            key=log[off][0],
                        )
                        for off in range(start, len(log))
                    ]
                    self.positions[tp] = len(log)
            if out:
                return out
            self.arrived.clear()
            await self.arrived.wait()


@dataclass
class FakeSink:
    """Records what it is handed; unfollows a partition when a stream there ends, as the
    gateway does for a resumed stream's foreign partition."""

    reader: ResultReader
    seen: list[ResultRecord]
    unfollow_on_done: TopicPartition | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    wanted: set[bytes] | None = None  # the keys of streams here; None: every key
    handed: int = 0  # batches handed over, parsed or not

    def wants(self, key: bytes | None) -> bool:
        return self.wanted is None or key in self.wanted

    def on_fetched(
        self,
        consumer: object,
        fetched: Mapping[TopicPartition, Sequence[ConsumerRecord[bytes, bytes]]],
    ) -> None:
        self.handed += 1
        self.progress.set()

    def on_control(self, value: bytes) -> None:
        pass

    def on_results(
        self, results: Sequence[tuple[ConsumerRecord[bytes, bytes], ResultRecord]]
    ) -> None:
        self.progress.set()
        for _, result in results:
            self.seen.append(result)
            if isinstance(result, DoneResult) and self.unfollow_on_done is not None:
                self.reader.unfollow(self.unfollow_on_done)


def _delta(request_id: str, seq: int) -> bytes:
    return (
        DeltaResult(request_id=request_id, attempt=0, seq=seq, text="x").model_dump_json().encode()
    )


def _done(request_id: str, seq: int) -> bytes:
    return (
        DoneResult(
            request_id=request_id,
            attempt=0,
            seq=seq,
            finish_reason="stop",
            usage=Usage(prompt_tokens=1, completion_tokens=seq),
            timings=Timings(queue_ms=0, batch_size=1, ttft_ms=1, total_ms=1),
        )
        .model_dump_json()
        .encode()
    )


async def _until(predicate: Callable[[], object], what: str, progress: asyncio.Event) -> None:
    try:
        async with asyncio.timeout(10):
            while not predicate():
                progress.clear()
                await progress.wait()
    except TimeoutError:
        raise AssertionError(f"not within 10 s: {what}") from None


def test_a_change_asked_for_while_results_are_handed_over_does_not_stop_the_reader() -> None:
    async def scenario() -> None:
        consumer = FakeConsumer()
        reader = ResultReader(consumer, CONTROL)  # type: ignore[arg-type]
        await reader.start(OWN)
        sink = FakeSink(reader, [], unfollow_on_done=FOREIGN)
        # A resumed stream reads a foreign partition; its done is read there.
        caught: list[bool] = []
        reader.follow(FOREIGN, 0, 1, lambda: caught.append(True))
        consumer.append(FOREIGN, _done("resumed", 0))
        run = asyncio.create_task(reader.run(sink))
        run.add_done_callback(lambda _: sink.progress.set())
        await _until(lambda: caught and sink.seen, "the resumed stream's done", sink.progress)
        # Let the reader go round a few times with nothing to read (no fixed sleep: loop
        # turns): the unfollow asked for inside on_results is applied, the reader waits on.
        for _ in range(20):
            await asyncio.sleep(0)
        assert not run.done(), run
        # Live results still flow.
        for n in range(3):
            consumer.append(OWN, _delta("live", n))
            await _until(
                lambda want=n + 2: len(sink.seen) == want or run.done(),
                f"live delta {n}",
                sink.progress,
            )
            assert not run.done(), run
        assert FOREIGN not in consumer.assigned
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        assert run.cancelled()

    asyncio.run(scenario())


def test_many_changes_between_fetches_lose_no_record() -> None:
    async def scenario() -> None:
        consumer = FakeConsumer()
        reader = ResultReader(consumer, CONTROL)  # type: ignore[arg-type]
        await reader.start(OWN)
        sink = FakeSink(reader, [])
        run = asyncio.create_task(reader.run(sink))
        run.add_done_callback(lambda _: sink.progress.set())
        for n in range(50):
            consumer.append(OWN, _delta("r", n))
            if n % 3 == 0:
                reader.follow(FOREIGN, 0)
            if n % 3 == 1:
                reader.unfollow(FOREIGN)
            await asyncio.sleep(0)
        await _until(lambda: len(sink.seen) == 50 or run.done(), "every record", sink.progress)
        assert not run.done(), run
        assert [r.seq for r in sink.seen] == list(range(50))
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run

    asyncio.run(scenario())


def test_a_followed_partitions_records_of_other_streams_are_not_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 37, N8: a stream resumed from another edge's partition makes the reader follow
    that partition; its other streams' records are skipped by key, never parsed here."""
    parsed: list[bytes] = []

    def counting(kind: TypeAdapter[ResultRecord], raw: bytes) -> ResultRecord:
        parsed.append(raw)
        return read(kind, raw)

    monkeypatch.setattr(results_module, "read", counting)

    async def scenario() -> None:
        consumer = FakeConsumer()
        reader = ResultReader(consumer, CONTROL)  # type: ignore[arg-type]
        await reader.start(OWN)
        sink = FakeSink(reader, [], wanted={b"resumed"})
        reader.follow(FOREIGN, 0)
        for n in range(200):  # the other edge's traffic
            consumer.append(
                FOREIGN, _delta(f"other-{n % 7}", n // 7), key=f"other-{n % 7}".encode()
            )
        consumer.append(FOREIGN, _done("resumed", 0), key=b"resumed")
        run = asyncio.create_task(reader.run(sink))
        run.add_done_callback(lambda _: sink.progress.set())
        await _until(lambda: sink.seen or run.done(), "the resumed stream's done", sink.progress)
        assert not run.done(), run
        assert [r.request_id for r in sink.seen] == ["resumed"]
        assert len(parsed) == 1, len(parsed)
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run

    asyncio.run(scenario())
