"""Publishing result records to a request's `reply_to`: the one place that decides where."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from shared.kafka import Headers, encode, key_of
from shared.messages import DeltaResult, DoneResult, ErrorResult, ReplyTo


async def send_result(
    producer: AIOKafkaProducer,
    reply_to: ReplyTo,
    record: DeltaResult | DoneResult | ErrorResult,
    headers: Headers | None = None,
) -> asyncio.Future[RecordMetadata]:
    """Queue a result record; await the returned future to know it is stored (acks=all)."""
    future: asyncio.Future[RecordMetadata] = await producer.send(
        reply_to.topic,
        encode(record),
        key=key_of(record.request_id),
        partition=reply_to.partition,
        headers=headers,
    )
    return future
