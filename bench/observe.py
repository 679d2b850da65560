"""A passive reader of a deployment's batches and heartbeats: batch sizes, and when it is idle."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable

import structlog
from aiokafka import AIOKafkaConsumer
from pydantic import BaseModel, ConfigDict, ValidationError

from shared.kafka import make_consumer
from shared.settings import TokenbusSettings
from shared.topics import Topics

log = structlog.get_logger()


class _View(BaseModel):
    # Only what the bench reads: fields other services add later must not break it.
    model_config = ConfigDict(extra="ignore", frozen=True)


class ObservedRequest(_View):
    request_id: str
    created_at: float  # the edge's stamp
    accepted_at: float  # ingest's stamp


class ObservedBatch(_View):
    batch_id: str
    tier: str
    reason: str
    formed_at: float
    requests: list[ObservedRequest]


class ObservedHeartbeat(_View):
    worker_id: str
    running: int
    queued_tokens: int
    sent_at: float


class DeploymentObserver:
    """Reads `batches` and `workers` from their live end while a run goes on; no group."""

    def __init__(self, settings: TokenbusSettings) -> None:
        self.topics = Topics(settings.topic_prefix)
        # Subscribed without a group: aiokafka assigns every partition of both topics.
        self._consumer: AIOKafkaConsumer = make_consumer(
            settings,
            self.topics.batches,
            self.topics.workers,
            group_id=None,
            client_id="bench-observer",
            auto_offset_reset="latest",
            # A fetch returns as soon as a record arrives: the long poll only saves the
            # broker the idle fetches (100/s at the default 10 ms), which would otherwise
            # compete with the stack under measurement for the same two cores.
            long_poll=True,
        )
        self._task: asyncio.Task[None] | None = None
        self.batches: list[ObservedBatch] = []
        self.heartbeats: dict[str, ObservedHeartbeat] = {}

    async def start(self, timeout_s: float = 15.0) -> None:
        await self._consumer.start()
        deadline = time.monotonic() + timeout_s
        wanted = {self.topics.batches, self.topics.workers}
        while {tp.topic for tp in self._consumer.assignment()} != wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench observer: no partitions of {sorted(wanted)} assigned")
            await asyncio.sleep(0.05)
        # Resolve every position now (the live end), so all later records are read.
        for tp in self._consumer.assignment():
            await self._consumer.position(tp)
        self._task = asyncio.create_task(self._read(), name="bench-observer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()

    def take_batches(self) -> list[ObservedBatch]:
        """The batches seen since the last call."""
        taken, self.batches = self.batches, []
        return taken

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait for a heartbeat of every known worker, sent from now on, that runs nothing."""
        since = time.time()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beats = list(self.heartbeats.values())
            if beats and all(
                b.sent_at >= since and b.running == 0 == b.queued_tokens for b in beats
            ):
                return True
            await asyncio.sleep(0.1)
        return False

    async def _read(self) -> None:
        while True:
            fetched = await self._consumer.getmany(timeout_ms=500)
            for tp, records in fetched.items():
                self._take(tp.topic, (r.value or b"" for r in records))

    def _take(self, topic: str, values: Iterable[bytes]) -> None:
        for value in values:
            try:
                if topic == self.topics.batches:
                    self.batches.append(ObservedBatch.model_validate_json(value))
                else:
                    beat = ObservedHeartbeat.model_validate_json(value)
                    self.heartbeats[beat.worker_id] = beat
            except ValidationError as exc:
                # A record this bench cannot read costs it a sample, not the run.
                log.warning("bench.observer.unreadable", topic=topic, error=str(exc)[:200])
