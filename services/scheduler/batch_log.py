"""Reading back the batches topic: what was dispatched, for restarts and dead-worker recovery."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic import ValidationError

from shared.messages import Batch, error_message
from shared.records import read

log = structlog.get_logger()

FETCH_TIMEOUT_MS = 500


@dataclass(frozen=True)
class LoggedBatch:
    tp: TopicPartition
    offset: int
    batch: Batch
    timestamp_ms: int = 0  # the batch record's timestamp (when it was dispatched)


class BatchLog:
    """A group-less consumer of the batches topic, pointed at ranges on demand.

    One owner at a time (the caller serialises): reads from the given start offsets up to
    the end offsets as they are when the read begins.
    """

    def __init__(self, consumer: AIOKafkaConsumer) -> None:
        self._consumer = consumer

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        ends: dict[TopicPartition, int] = await self._consumer.end_offsets(tps)
        return ends

    async def read(self, starts: Mapping[TopicPartition, int]) -> list[LoggedBatch]:
        if not starts:
            return []
        ends = await self.end_offsets(list(starts))
        todo = {tp: end for tp, end in ends.items() if end > starts[tp]}
        if not todo:
            return []
        c = self._consumer
        c.assign(list(todo))
        for tp in todo:
            c.seek(tp, max(0, starts[tp]))
        out: list[LoggedBatch] = []
        while todo:
            fetched = await c.getmany(*todo, timeout_ms=FETCH_TIMEOUT_MS)
            for tp, records in fetched.items():
                for record in records:
                    if record.offset >= todo.get(tp, 0):
                        continue
                    try:
                        batch = read(Batch, record.value or b"")
                    except ValidationError as exc:
                        log.error(
                            "batch_log.invalid", offset=record.offset, error=error_message(exc)
                        )
                        continue
                    out.append(LoggedBatch(tp, record.offset, batch, record.timestamp))
            for tp in list(todo):
                if await c.position(tp) >= todo[tp]:
                    del todo[tp]
        c.assign([])
        return out
