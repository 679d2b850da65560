"""A compacted topic read as a table: key -> the latest value, with the offset it was written
at, caught up to the topic's end as it is at each call (read-your-writes across processes).

One reader for the small compacted tables a request reads before it answers (the files'
records, ADR 0074; the batches', ADR 0075). Its consumer starts on the first catch-up, so a
process never asked about the table never reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic import ValidationError

from shared.kafka import make_consumer
from shared.settings import TokenbusSettings

log = structlog.get_logger()

T = TypeVar("T")
FETCH_MS = 500
# How long one catch-up may take before it is given up on (the caller answers 503).
READ_TIMEOUT_S = 30.0


class Table(Generic[T]):
    """`topic` (compacted) as key -> (partition, offset, value); `parse` reads a record's
    value by its key (a ValidationError: the record is skipped, and logged)."""

    def __init__(
        self,
        settings: TokenbusSettings,
        topic: str,
        partitions: int,
        parse: Callable[[str, bytes], T],
        client_id: str,
    ) -> None:
        self._settings = settings
        self._parts = [TopicPartition(topic, p) for p in range(partitions)]
        self._parse = parse
        self._client_id = client_id
        self.rows: dict[str, tuple[int, int, T]] = {}
        self._reader: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()

    def get(self, key: str) -> T | None:
        row = self.rows.get(key)
        return None if row is None else row[2]

    def put(self, key: str, partition: int, offset: int, value: T) -> None:
        """A value this process wrote (acknowledged at `offset`): seen before the next
        catch-up reads it back."""
        self.rows[key] = (partition, offset, value)

    def drop(self, key: str) -> None:
        self.rows.pop(key, None)

    async def catch_up(self) -> None:
        """Read every partition up to its end offset as it is now."""
        async with self._lock, asyncio.timeout(READ_TIMEOUT_S):
            reader = await self._started()
            ends = await reader.end_offsets(self._parts)
            behind = {tp for tp in self._parts if await reader.position(tp) < ends[tp]}
            while behind:
                fetched = await reader.getmany(*behind, timeout_ms=FETCH_MS)
                for tp, records in fetched.items():
                    for record in records:
                        self._apply(tp.partition, record.key, record.value, record.offset)
                behind = {tp for tp in behind if await reader.position(tp) < ends[tp]}

    async def stop(self) -> None:
        if self._reader is not None:
            await self._reader.stop()

    async def _started(self) -> AIOKafkaConsumer:
        if self._reader is None:
            reader = make_consumer(
                self._settings, group_id=None, client_id=self._client_id, fetch_max_wait_ms=FETCH_MS
            )
            await reader.start()
            reader.assign(self._parts)
            await reader.seek_to_beginning(*self._parts)
            self._reader = reader
        return self._reader

    def _apply(self, partition: int, key: bytes | None, value: bytes | None, offset: int) -> None:
        if key is None:
            return
        name = key.decode()
        if value is None:
            self.rows.pop(name, None)
            return
        try:
            self.rows[name] = (partition, offset, self._parse(name, value))
        except ValidationError as exc:  # not one of the table's records: nothing lost
            log.warning(
                "table.bad_record", client=self._client_id, offset=offset, error=str(exc)[:200]
            )
