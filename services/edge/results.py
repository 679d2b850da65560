"""The edge's one Kafka consumer: reads its result partition and routes records to sockets."""

from __future__ import annotations

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic import TypeAdapter, ValidationError

from services.edge.streams import StreamRouter
from shared.messages import ResultRecord

log = structlog.get_logger()

_results: TypeAdapter[ResultRecord] = TypeAdapter(ResultRecord)


class ResultReader:
    """Owns the consumer of one result partition; `position` is safe to resume from."""

    def __init__(self, consumer: AIOKafkaConsumer, tp: TopicPartition, router: StreamRouter):
        self._consumer = consumer
        self.tp = tp
        self._router = router
        self.position: int | None = None

    async def start(self) -> None:
        self._consumer.assign([self.tp])
        await self._consumer.seek_to_end(self.tp)
        self.position = await self._consumer.position(self.tp)

    async def run(self) -> None:
        while True:
            fetched = await self._consumer.getmany(self.tp, timeout_ms=1000)
            for record in fetched.get(self.tp, []):
                self.position = record.offset + 1
                try:
                    result = _results.validate_json(record.value or b"")
                except ValidationError as exc:
                    log.error("result.invalid", offset=record.offset, error=str(exc))
                    continue
                self._router.route(result)
