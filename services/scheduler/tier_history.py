"""What a tier partition held just before its committed offset: the dedupe a restart rebuilds.

The scheduler drops a second copy of a `(request_id, attempt)` read from a tier partition
(a request handed back twice: by the recovery of a worker declared dead, and by that
worker itself once it woke and fenced itself). That memory was the process's own, so a
scheduler restarted between the two copies let the second run beside the first: two
workers, one attempt, two chunkings in one stream (ADR 0014 "Left open"; ADR 0021). Both
copies are keyed by request id, so they land on the same partition, seconds apart: a
take-over reads the partition back from `LOOKBACK_S` before now up to its committed offset
and remembers every `(request_id, attempt)` there, as the process that handed them on did,
with the copy's `requeued` count: a request moved to the tail (requeue.py) is read there
under its next count, and is not a second copy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition

from services.scheduler.admission import Copy
from shared.kafka import make_consumer
from shared.settings import TokenbusSettings

log = structlog.get_logger()

LOOKBACK_S = 120.0  # two copies of one hand-back are seconds apart; this is ample
FETCH_TIMEOUT_MS = 500


def key_of_record(value: bytes | None) -> Copy | None:
    """`(request_id, attempt, requeued)` of a tier record; None if it has none (poison)."""
    try:
        body = json.loads(value or b"")
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    request_id, attempt = body.get("request_id"), body.get("attempt", 0)
    requeued = body.get("requeued", 0)
    if not all(isinstance(n, int) for n in (attempt, requeued)) or not isinstance(request_id, str):
        return None
    return request_id, attempt, requeued


async def recent_keys(
    settings: TokenbusSettings, committed: Mapping[TopicPartition, int], client_id: str
) -> dict[TopicPartition, list[Copy]]:
    """Per partition, the keys of its committed records from LOOKBACK_S ago to `committed`.

    Read committed, as the tier reader reads: a hand-back whose transaction was aborted
    (a recovery fenced) was never a copy, and must not hide the one that was committed.
    """
    if not committed:
        return {}
    consumer = make_consumer(
        settings, group_id=None, client_id=client_id, isolation_level="read_committed"
    )
    await consumer.start()
    try:
        return await _read(consumer, committed)
    finally:
        await consumer.stop()


async def _read(
    consumer: AIOKafkaConsumer, committed: Mapping[TopicPartition, int]
) -> dict[TopicPartition, list[Copy]]:
    since = int((time.time() - LOOKBACK_S) * 1000)
    found = await consumer.offsets_for_times({tp: since for tp in committed})
    todo: dict[TopicPartition, int] = {}
    starts: dict[TopicPartition, int] = {}
    for tp, end in committed.items():
        at = found.get(tp)
        start = end if at is None else min(at.offset, end)
        if start < end:
            starts[tp], todo[tp] = start, end
    out: dict[TopicPartition, list[Copy]] = {tp: [] for tp in committed}
    if not todo:
        return out
    consumer.assign(list(todo))
    for tp, start in starts.items():
        consumer.seek(tp, start)
    while todo:
        fetched = await consumer.getmany(*todo, timeout_ms=FETCH_TIMEOUT_MS)
        for tp, records in fetched.items():
            for record in records:
                if record.offset >= todo.get(tp, 0):
                    continue
                key = key_of_record(record.value)
                if key is not None:
                    out[tp].append(key)
        for tp in list(todo):
            if await consumer.position(tp) >= todo[tp]:
                del todo[tp]
    return out
