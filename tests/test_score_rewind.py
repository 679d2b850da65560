"""A scheduler that starts reads back the last canary window of shadow scores (scores.py),
so a restart keeps the evidence its canary verdicts rest on; scores made before it started
feed its windows but not its metrics (its predecessor counted them)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from services.scheduler.scores import ScoreMetrics, ScoreReader
from shared.kafka import create_topics, delete_topics, encode, make_consumer, make_producer
from shared.settings import TokenbusSettings
from shared.shadows import ShadowScore
from shared.topics import Topics
from tests.stack import new_prefix

pytestmark = pytest.mark.kafka


def shadow_score(request_id: str, scored_at: float) -> ShadowScore:
    return ShadowScore(
        model="m",
        variant="canary",
        gold="baseline",
        request_id=request_id,
        exact=False,
        f1=0.5,
        rouge_l=0.5,
        quality=0.0,
        deterministic=True,
        scored_at=scored_at,
    )


async def until(condition: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.05)


async def test_a_starting_reader_reads_back_one_window_of_scores(bootstrap: str) -> None:
    settings = TokenbusSettings(bootstrap_servers=bootstrap, topic_prefix=new_prefix())
    topic = Topics(settings.topic_prefix).scores
    await create_topics(settings, {topic: 2})
    producer = make_producer(settings, client_id="rewind-test")
    await producer.start()
    consumer = make_consumer(
        settings, topic, group_id=None, client_id="rewind-test-scores", auto_offset_reset="latest"
    )
    task: asyncio.Task[None] | None = None
    try:
        earlier = time.time() - 5
        for i in range(4):  # spread over both partitions by key
            record = encode(shadow_score(f"before-{i}", earlier))
            await producer.send_and_wait(topic, record, key=f"k{i}".encode())
        seen: list[str] = []
        metrics = ScoreMetrics.build(CollectorRegistry())
        reader = ScoreReader(consumer, lambda s: seen.append(s.request_id), metrics, rewind_s=60.0)
        await consumer.start()
        task = asyncio.create_task(reader.run())
        await until(lambda: len(seen) == 4, 20, "the scores of the window before the start")
        assert sorted(seen) == [f"before-{i}" for i in range(4)]
        counted = metrics.quality.labels("m", "canary")
        assert counted._sum.get() == 0  # fed to the windows, not counted again
        await producer.send_and_wait(topic, encode(shadow_score("after", time.time())))
        await until(lambda: "after" in seen, 20, "a score made after the start")
        assert metrics.scores.labels("m", "canary", "baseline", "false")._value.get() == 1
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await consumer.stop()
        await producer.stop()
        await delete_topics(settings, [topic])
