"""A resume's replay (services/edge/replay.py) on a real broker, and the reader's `join`.

The replay reads one stream's records with a consumer of its own, up to the log end of the
resume and to where the shared reader stands, and hands over in that same turn; it is
bounded in records and in time. `ResultReader.join` never rewinds a partition it reads.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from services.edge.replay import Replayed, ReplayRefused, Replays
from services.edge.results import ResultReader
from shared.kafka import create_topics, encode, key_of, make_consumer, make_producer
from shared.messages import DeltaResult, ErrorCode
from shared.settings import TokenbusSettings
from tests.test_edge_reader import CONTROL, FOREIGN, OWN, FakeConsumer


def _settings(bootstrap: str) -> TokenbusSettings:
    return TokenbusSettings(bootstrap_servers=bootstrap)


async def _topic_with(bootstrap: str, records: list[DeltaResult]) -> TopicPartition:
    topic = f"replay-{uuid.uuid4().hex[:10]}"
    await create_topics(_settings(bootstrap), {topic: 1}, replication=1)
    producer = make_producer(_settings(bootstrap), client_id="replay-test")
    await producer.start()
    try:
        for record in records:
            await producer.send(topic, encode(record), key=key_of(record.request_id))
        await producer.flush()
    finally:
        await producer.stop()
    return TopicPartition(topic, 0)


def _replays(bootstrap: str, **bounds: float) -> Replays:
    settings = _settings(bootstrap)
    return Replays(
        lambda: make_consumer(settings, group_id=None, client_id="replay-test"),
        timeout_s=float(bounds.get("timeout_s", 10.0)),
        max_records=int(bounds.get("max_records", 10_000)),
        concurrency=2,
    )


def _mixed(count: int) -> list[DeltaResult]:
    """`count` deltas of each of two streams, interleaved: ours and another tenant's."""
    out: list[DeltaResult] = []
    for seq in range(count):
        out.append(DeltaResult(request_id="ours", attempt=0, seq=seq, text=f"o{seq} "))
        out.append(DeltaResult(request_id="theirs", attempt=0, seq=seq, text=f"t{seq} "))
    return out


def test_a_replay_reads_only_its_stream_in_order_and_hands_over_at_the_log_end(
    bootstrap: str,
) -> None:
    async def scenario() -> None:
        tp = await _topic_with(bootstrap, _mixed(300))
        attached: list[Replayed] = []
        replayed = await _replays(bootstrap).read(
            tp, "ours", start=0, end=600, live=lambda: None, attach=attached.append
        )
        assert attached == [replayed]
        assert [r.seq for r in replayed.records] == list(range(300))
        assert {r.request_id for r in replayed.records} == {"ours"}
        assert replayed.position == 600
        assert replayed.scanned == 600

    asyncio.run(scenario())


def test_a_replay_reads_on_to_where_the_shared_reader_stands(bootstrap: str) -> None:
    async def scenario() -> None:
        tp = await _topic_with(bootstrap, _mixed(50))
        # The resume's log end was 40, but the shared reader has read to 90 meanwhile:
        # records 40-89 must come from the replay, or nothing would show them.
        attached: list[Replayed] = []
        replayed = await _replays(bootstrap).read(
            tp, "ours", start=0, end=40, live=lambda: 90, attach=attached.append
        )
        assert replayed.position >= 90
        assert [r.seq for r in replayed.records][:45] == list(range(45))

    asyncio.run(scenario())


def test_a_stream_at_its_log_end_is_attached_without_reading(bootstrap: str) -> None:
    async def scenario() -> None:
        built: list[int] = []

        def consumer() -> object:
            built.append(1)
            raise AssertionError("no consumer is needed when nothing is to be read")

        replays = Replays(consumer, timeout_s=5, max_records=10, concurrency=1)  # type: ignore[arg-type]
        attached: list[Replayed] = []
        tp = TopicPartition("never-read", 0)
        replayed = await replays.read(
            tp, "ours", start=7, end=7, live=lambda: 7, attach=attached.append
        )
        assert attached == [replayed]
        assert replayed.position == 7
        assert not built

    asyncio.run(scenario())


def test_a_replay_too_far_back_is_refused_not_found(bootstrap: str) -> None:
    async def scenario() -> None:
        tp = await _topic_with(bootstrap, _mixed(100))
        attached: list[Replayed] = []
        with pytest.raises(ReplayRefused) as refused:
            await _replays(bootstrap, max_records=50).read(
                tp, "ours", start=0, end=200, live=lambda: None, attach=attached.append
            )
        assert refused.value.code is ErrorCode.not_found
        assert not attached

    asyncio.run(scenario())


def test_a_replay_that_cannot_catch_up_ends_within_its_timeout(bootstrap: str) -> None:
    async def scenario() -> None:
        tp = await _topic_with(bootstrap, _mixed(10))
        attached: list[Replayed] = []
        started = time.monotonic()
        with pytest.raises(ReplayRefused) as refused:
            # A shared reader position the log never reaches: the replay waits in vain.
            await _replays(bootstrap, timeout_s=1.5).read(
                tp, "ours", start=0, end=20, live=lambda: 10_000, attach=attached.append
            )
        assert refused.value.code is ErrorCode.overloaded
        assert time.monotonic() - started < 6.0
        assert not attached

    asyncio.run(scenario())


def test_join_never_rewinds_a_partition_the_reader_reads() -> None:
    async def scenario() -> None:
        consumer = FakeConsumer()
        for n in range(5):
            consumer.append(OWN, b"x%d" % n)
        reader = ResultReader(consumer, CONTROL)  # type: ignore[arg-type]
        await reader.start(OWN)
        assert reader.position(OWN) == 5
        reader.join(OWN, 0)  # a replay asked for offset 0: the shared reader stays at 5
        assert reader.position(OWN) == 5
        reader.join(FOREIGN, 3)  # not read yet: from the replay's position, at once
        assert reader.position(FOREIGN) == 3
        reader.join(FOREIGN, 0)  # a second stream there: no rewind either
        assert reader.position(FOREIGN) == 3
        reader.unfollow(FOREIGN)
        reader.unfollow(FOREIGN)

    asyncio.run(scenario())


def test_a_replay_attached_is_not_refused_when_its_consumer_stops_slowly(
    bootstrap: str,
) -> None:
    """The timeout covers the read up to the hand-over, not the consumer's stop after it.

    Chaos seed 603794555 (finding 12): a consumer stop that outlasted the timeout (a broker
    node hung) turned a replay already attached into an `overloaded` refusal; the client,
    which had just been shown the stream's `done`, was then sent an `error` after it.
    """

    class SlowToStop(AIOKafkaConsumer):  # type: ignore[misc]
        async def stop(self) -> None:
            await asyncio.sleep(2.0)  # longer than the replay's whole timeout
            await super().stop()

    async def scenario() -> None:
        tp = await _topic_with(bootstrap, _mixed(10))
        settings = _settings(bootstrap)
        replays = Replays(
            lambda: SlowToStop(
                bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False
            ),
            timeout_s=1.0,
            max_records=1000,
            concurrency=1,
        )
        attached: list[Replayed] = []
        replayed = await replays.read(
            tp, "ours", start=0, end=20, live=lambda: None, attach=attached.append
        )
        assert attached == [replayed]
        assert [r.seq for r in replayed.records] == list(range(10))
        await replays.aclose()

    asyncio.run(scenario())


def _streams(count: int, deltas: int) -> list[DeltaResult]:
    """`deltas` deltas of each of `count` streams, interleaved."""
    return [
        DeltaResult(request_id=f"s{n}", attempt=0, seq=seq, text=f"{n}.{seq} ")
        for seq in range(deltas)
        for n in range(count)
    ]


class _Counted:
    """A consumer factory that counts the consumers it built."""

    def __init__(self, bootstrap: str) -> None:
        self.settings = _settings(bootstrap)
        self.built = 0

    def __call__(self) -> AIOKafkaConsumer:
        self.built += 1
        return make_consumer(self.settings, group_id=None, client_id="replay-test")


def test_every_resume_of_a_partition_shares_one_consumer(bootstrap: str) -> None:
    """An edge's clients coming back after a kill resume many streams of one partition at
    once: one consumer reads it for all (chaos seed 294815970: a consumer each read the
    same records a hundred times over, and resumes were refused for minutes)."""

    async def scenario() -> None:
        tp = await _topic_with(bootstrap, _streams(30, 20))
        factory = _Counted(bootstrap)
        replays = Replays(factory, timeout_s=10.0, max_records=10_000, concurrency=1)
        attached: list[str] = []
        results = await asyncio.gather(
            *(
                replays.read(
                    tp,
                    f"s{n}",
                    start=n,  # each stream's first record
                    end=600,
                    live=lambda: None,
                    attach=lambda r, n=n: attached.append(f"s{n}"),
                )
                for n in range(30)
            )
        )
        for n, replayed in enumerate(results):
            assert [r.seq for r in replayed.records] == list(range(20)), n
            assert {r.request_id for r in replayed.records} == {f"s{n}"}
            assert replayed.position == 600
            assert replayed.scanned == 600 - n
        assert sorted(attached) == sorted(f"s{n}" for n in range(30))
        assert factory.built == 1
        await replays.aclose()

    asyncio.run(scenario())


def test_a_resume_from_behind_a_running_read_is_served_in_a_round_of_its_own(
    bootstrap: str,
) -> None:
    async def scenario() -> None:
        tp = await _topic_with(bootstrap, _mixed(100))
        factory = _Counted(bootstrap)
        replays = Replays(factory, timeout_s=20.0, max_records=10_000, concurrency=1)
        # The first resume waits for a shared reader position the log has not reached, so
        # its round reads on at the log end while the second comes, from offset 0.
        far: dict[str, int | None] = {"live": 10_000}
        looked = 0

        def first_live() -> int | None:
            nonlocal looked
            looked += 1
            return far["live"]

        first = asyncio.create_task(
            replays.read(tp, "theirs", start=101, end=200, live=first_live, attach=lambda r: None)
        )
        deadline = time.monotonic() + 10
        while looked < 3:  # the round has fetched (2000 records a fetch: all 200) twice
            assert time.monotonic() < deadline, "the first replay never read"
            await asyncio.sleep(0.02)
        second = asyncio.create_task(
            replays.read(tp, "ours", start=0, end=200, live=lambda: None, attach=lambda r: None)
        )
        await asyncio.sleep(0)  # registered while the first round stands at the log end
        far["live"] = None
        behind, ahead = await second, await first
        assert [r.seq for r in behind.records] == list(range(100))
        assert [r.seq for r in ahead.records] == list(range(50, 100))
        assert factory.built == 1  # the next round seeks back on the same consumer
        await replays.aclose()

    asyncio.run(scenario())
