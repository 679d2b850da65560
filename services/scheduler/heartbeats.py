"""The heartbeat reader: workers' free slots and liveness, from `tokenbus.workers`.

A heartbeat that cannot be used is dead-lettered and skipped. On start, heartbeats of the
last minute are read back, but only one fresh enough is proof of life.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic import ValidationError

from services.scheduler.answers import Answerer
from services.scheduler.workers import WorkerRegistry
from shared.fetches import fetches
from shared.messages import LEAVING_HEADER, Heartbeat, error_message
from shared.records import read

log = structlog.get_logger()

FETCH_MS = 500  # longest one getmany waits
HEARTBEAT_LOOKBACK_S = 60.0  # on start, heartbeats this recent say who is alive


class HeartbeatReader:
    """Feeds heartbeats to the worker registry. Owner of `consumer` (assigned, no group)."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        workers: WorkerRegistry,
        answerer: Answerer,
        batch_partitions: Callable[[], set[int]],
        batches_topic: str,
        wake: asyncio.Event,
        observe: Callable[[Heartbeat], None] = lambda _: None,
    ) -> None:
        self._consumer = consumer
        self._workers = workers
        self._answerer = answerer
        self._batch_partitions = batch_partitions
        self._batches_topic = batches_topic
        self._wake = wake
        self._observe = observe  # told every usable beat, replayed ones too (the canaries')
        self._live_from: dict[TopicPartition, int] = {}  # heartbeats below: replayed

    async def seek_recent(self, tps: list[TopicPartition]) -> None:
        """Start at the heartbeats of the last `HEARTBEAT_LOOKBACK_S`."""
        beats = self._consumer
        beats.assign(tps)
        since = int((time.time() - HEARTBEAT_LOOKBACK_S) * 1000)
        found = await beats.offsets_for_times({tp: since for tp in tps})
        self._live_from = await beats.end_offsets(tps)
        for tp in tps:
            at = found.get(tp)
            if at is None:
                await beats.seek_to_end(tp)
            else:
                beats.seek(tp, at.offset)

    async def run(self) -> None:
        async for fetched in fetches(self._consumer, what="heartbeats", timeout_ms=FETCH_MS):
            now = time.time()
            for tp, records in fetched.items():
                live_from = self._live_from.get(tp, 0)
                for record in records:
                    try:
                        beat = read(Heartbeat, record.value or b"")
                        problem = self._problem(beat)
                    except ValidationError as exc:
                        problem = error_message(exc)
                    if problem is not None:
                        log.error("heartbeat.invalid", offset=record.offset, error=problem)
                        await self._answerer.dead_letter(record, f"invalid heartbeat: {problem}")
                        continue
                    self._observe(beat)
                    # Read back at start-up: proof of life only if it is this fresh.
                    stale = now - beat.sent_at > beat.interval_ms / 1000.0
                    replayed = record.offset < live_from and stale
                    leaving = (LEAVING_HEADER, b"1") in (record.headers or ())
                    if self._workers.beat(beat, now, replayed=replayed, leaving=leaving) and (
                        not replayed
                    ):
                        log.info(
                            "worker.registered",
                            worker_id=beat.worker_id,
                            partition=beat.batch_partition,
                            started_at=beat.started_at,
                            registered=len(self._workers),
                        )
            if fetched:
                self._wake.set()

    def _problem(self, beat: Heartbeat) -> str | None:
        """Why a well-formed heartbeat cannot be used here (a partition we cannot send to)."""
        partition = beat.batch_partition
        known = self._batch_partitions()
        if partition is not None and known and partition not in known:
            return (
                f"batch_partition {partition} is not a partition of {self._batches_topic}"
                f" ({len(known)} partitions)"
            )
        return None
