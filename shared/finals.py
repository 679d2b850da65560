"""Which requests already have their final record on their `reply_to`: never run them again.

A worker killed with -9 just after it wrote a request's `done` (before its next heartbeat or
offset commit said so) leaves that request looking unfinished to whoever takes its work
over: the scheduler's recovery and the worker's own next process. Both ask here first,
and leave out every request with a `done` or `error` (any attempt) written since its batch
was dispatched. Rare (a death), so one group-less consumer per question is cheap enough.

The read is bounded; when it fails, the caller is told nothing is answered (runs everything
again: at least once, never lost) and the failure is logged.

`since_ms` is the batch record's timestamp (the scheduler's clock), a final's is the worker's:
the read starts `shared/clocks.py`'s margin earlier, so that a worker whose clock runs behind
is not taken for one that never answered (a request answered would run again). A worker
further behind than the margin gets its requests run again: at least once, never lost.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import structlog
from aiokafka import TopicPartition
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaError

from shared.clocks import since_with_margin_ms
from shared.kafka import make_consumer
from shared.messages import QueuedRequest
from shared.settings import TokenbusSettings

log = structlog.get_logger()

FINAL_KINDS = frozenset({"done", "error"})
FETCH_MS = 200
# Each call's own bound: a hung node (SIGSTOP, a black hole) then costs this much before
# the next node is asked, not aiokafka's 40 s, which would spend the caller's whole budget.
REQUEST_TIMEOUT_MS = 1500


async def answered(
    settings: TokenbusSettings,
    requests: Sequence[QueuedRequest],
    since_ms: int,
    timeout_s: float,
    *,
    client_id: str,
) -> set[str]:
    """The ids of `requests` whose `reply_to` holds a final record written since `since_ms`
    (by another clock than the caller's: with `shared/clocks.py`'s margin).

    Empty (answer nothing: run everything again) if the read fails or takes longer than
    `timeout_s`; the failure is logged as `finals.check_failed`.
    """
    if not requests:
        return set()
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(settings, requests, since_ms, client_id)
    except (KafkaError, TimeoutError, OSError) as exc:
        log.warning("finals.check_failed", error=repr(exc), requests=len(requests))
        return set()


async def _read(
    settings: TokenbusSettings, requests: Sequence[QueuedRequest], since_ms: int, client_id: str
) -> set[str]:
    wanted = {r.request_id for r in requests}
    consumer = make_consumer(
        settings,
        group_id=None,
        client_id=client_id,
        fetch_max_wait_ms=FETCH_MS,
        request_timeout_ms=REQUEST_TIMEOUT_MS,
    )
    await consumer.start()
    try:
        # One metadata request for just these topics (as shared/results.py does).
        cluster = ClusterMetadata()
        topics = sorted({r.reply_to.topic for r in requests})
        if not await consumer._client._metadata_update(cluster, topics):
            raise KafkaError("no broker answered the metadata request")
        tps = _partitions(requests, cluster)
        if not tps:
            return set()
        consumer.assign(sorted(tps))
        earliest = since_with_margin_ms(since_ms)
        found = await consumer.offsets_for_times({tp: earliest for tp in tps})
        ends = await consumer.end_offsets(sorted(tps))
        todo: dict[TopicPartition, int] = {}
        for tp in tps:
            at = found.get(tp)
            if at is not None and at.offset < ends[tp]:
                consumer.seek(tp, at.offset)
                todo[tp] = ends[tp]
        out: set[str] = set()
        while todo:
            fetched = await consumer.getmany(*todo, timeout_ms=FETCH_MS)
            for records in fetched.values():
                for record in records:
                    request_id = final_of(record.value)
                    if request_id in wanted:
                        out.add(request_id)
            for tp in list(todo):
                if await consumer.position(tp) >= todo[tp]:
                    del todo[tp]
        return out
    finally:
        await consumer.stop()


def _partitions(requests: Sequence[QueuedRequest], cluster: ClusterMetadata) -> set[TopicPartition]:
    """Every partition a final can be on: the named one, else all (keyed, any of them)."""
    out: set[TopicPartition] = set()
    for request in requests:
        topic = request.reply_to.topic
        if request.reply_to.partition is not None:
            out.add(TopicPartition(topic, request.reply_to.partition))
            continue
        for partition in cluster.partitions_for_topic(topic) or ():
            out.add(TopicPartition(topic, partition))
    return out


def final_of(value: bytes | None) -> str | None:
    """The request id of a final result record (`done` or `error`); None for anything else."""
    try:
        body = json.loads(value or b"")
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("kind") not in FINAL_KINDS:
        return None
    request_id = body.get("request_id")
    return request_id if isinstance(request_id, str) else None
