"""Obeying cancels: abort in the engine, time how soon the slot is free, remember early ones."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord
from pydantic import TypeAdapter, ValidationError

from services.worker.answers import Answers
from services.worker.engines.base import Engine
from services.worker.settings import WorkerSettings
from shared.fetches import fetches
from shared.kafka import make_consumer
from shared.messages import CancelRecord, ControlRecord, error_message
from shared.records import read
from shared.topics import Topics

log = structlog.get_logger()

_control_records: TypeAdapter[ControlRecord] = TypeAdapter(ControlRecord)
FETCH_MS = 1000  # longest one read of the control topic waits (getmany's default is none)


@dataclass(frozen=True)
class CancelApplied:
    """What one cancel did, for the `cancel.applied` log line that tests and benches read."""

    request_id: str
    found: bool  # the request was in the engine (running or queued)
    free_slots_before: int
    free_slots_after: int
    total_slots: int
    arrival_to_free_ms: float  # record handed to the worker -> engine reports the slot free
    record_age_ms: float  # the canceller's sent_at -> arrival at the worker (the Kafka hop)


class CancelBook:
    """Cancels whose request is not (yet) here: a batch may arrive after its cancel.

    Pure and bounded: ids are kept for `ttl_s` seconds of the caller's clock, at most `limit`.
    """

    def __init__(self, ttl_s: float = 300.0, limit: int = 10_000) -> None:
        self._ttl_s = ttl_s
        self._limit = limit
        self._ids: OrderedDict[str, float] = OrderedDict()

    def remember(self, request_id: str, now: float) -> None:
        self._ids[request_id] = now
        self._ids.move_to_end(request_id)
        self._prune(now)

    def take(self, request_id: str, now: float) -> bool:
        """True (once) if this request was cancelled before it arrived."""
        self._prune(now)
        return self._ids.pop(request_id, None) is not None

    def _prune(self, now: float) -> None:
        while self._ids and (
            len(self._ids) > self._limit or next(iter(self._ids.values())) < now - self._ttl_s
        ):
            self._ids.popitem(last=False)


async def apply_cancel(
    engine: Engine, cancel: CancelRecord, arrived_at: float, arrived_wall: float
) -> CancelApplied:
    """Abort the request; `arrived_at` is `time.perf_counter()` when the record was handed over."""
    before = engine.capacity()
    found = await engine.abort(cancel.request_id)
    after = engine.capacity()
    freed_at = time.perf_counter()
    return CancelApplied(
        request_id=cancel.request_id,
        found=found,
        free_slots_before=before.free_slots,
        free_slots_after=after.free_slots,
        total_slots=after.total_slots,
        arrival_to_free_ms=round((freed_at - arrived_at) * 1000, 3),
        record_age_ms=round((arrived_wall - cancel.sent_at) * 1000, 3),
    )


def control_consumer(s: WorkerSettings, topics: Topics) -> AIOKafkaConsumer:
    """Every worker sees every cancel: no group, from the live end."""
    return make_consumer(
        s,
        topics.control,
        group_id=None,
        client_id=f"{s.worker_id}-control",
        auto_offset_reset="latest",
        long_poll=True,  # never seeks: a cancel ends the long poll at once
    )


class CancelListener:
    """Caller: the worker (`run` as a task on the control topic, which every worker reads).

    Affects: the engine (aborts), `early` (cancels whose batch has not come yet).
    """

    def __init__(self, engine: Engine, early: CancelBook, answers: Answers) -> None:
        self._engine = engine
        self._early = early
        self._answers = answers

    async def run(self, consumer: AIOKafkaConsumer) -> None:
        async for fetched in fetches(consumer, what="control", timeout_ms=FETCH_MS):
            for records in fetched.values():
                for record in records:
                    await self._obey(record)

    async def _obey(self, record: ConsumerRecord[bytes, bytes]) -> None:
        arrived_at, arrived_wall = time.perf_counter(), time.time()
        try:
            control = read(_control_records, record.value or b"")
        except ValidationError as exc:
            log.error("control.invalid", offset=record.offset, error=error_message(exc)[:500])
            await self._answers.dead_letter(record, f"invalid control record: {error_message(exc)}")
            return
        if not isinstance(control, CancelRecord):
            return  # edge-to-edge news (a resumed stream): nothing for a worker
        applied = await apply_cancel(self._engine, control, arrived_at, arrived_wall)
        if not applied.found:
            self._early.remember(control.request_id, time.monotonic())
        log.info(
            "cancel.applied",
            request_id=applied.request_id,
            found=applied.found,
            free_slots_before=applied.free_slots_before,
            free_slots_after=applied.free_slots_after,
            total_slots=applied.total_slots,
            arrival_to_free_ms=applied.arrival_to_free_ms,
            record_age_ms=applied.record_age_ms,
        )
