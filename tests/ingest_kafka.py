"""Kafka helpers of the ingest tests: collect results as they arrive, read the DLQ back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from shared.settings import TokenbusSettings
from tests.stack import read_records


@dataclass
class Arrival:
    body: dict[str, Any]
    partition: int
    at: float  # time.monotonic() on arrival


@dataclass
class Results:
    """Every result record on one topic (all partitions, from the start), by request id.

    Runs a consumer task while inside `async with`; `wait_for` polls with a deadline.
    """

    bootstrap: str
    topic: str
    partitions: int
    by_request: dict[str, list[Arrival]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Results:
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await consumer.start()
        parts = [TopicPartition(self.topic, p) for p in range(self.partitions)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        self._task = asyncio.create_task(self._pump(consumer))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _pump(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while True:
                for tp, records in (await consumer.getmany(timeout_ms=100)).items():
                    now = time.monotonic()
                    for r in records:
                        body = json.loads(r.value or b"{}")
                        arrival = Arrival(body, tp.partition, now)
                        self.by_request.setdefault(body.get("request_id", ""), []).append(arrival)
        finally:
            await consumer.stop()

    def final(self, request_id: str) -> Arrival | None:
        ends = [a for a in self.by_request.get(request_id, []) if a.body["kind"] != "delta"]
        return ends[0] if ends else None

    def finals(self, request_id: str) -> list[Arrival]:
        return [a for a in self.by_request.get(request_id, []) if a.body["kind"] != "delta"]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            await asyncio.sleep(0.05)


@dataclass(frozen=True)
class Letter:
    key: bytes | None
    value: bytes
    headers: dict[str, str]
    offset: int


async def read_all(bootstrap: str, topic: str, partitions: int) -> list[Letter]:
    """Every record on `topic` now (all partitions), with its headers as text."""
    settings = TokenbusSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap)
    return [
        Letter(r.key, r.value or b"", {k: (v or b"").decode() for k, v in r.headers}, r.offset)
        for r in await read_records(settings, topic, partitions)
    ]
