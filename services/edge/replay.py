"""A resume's replay: one stream's past records, read by a consumer of its own.

The edge's one reader (`results.py`) only moves forward on the partitions its streams share:
rewinding it for one resume would hold back every other stream on it, and a tenant could
freeze an edge with a resume a second. A resume reads its stream's records from the resume
token's offset with a short-lived consumer instead, bounded in time and in records read, and
hands over to the shared reader where that one stands:

    await replays.read(tp, request_id, start=offset, end=log_end, live=..., attach=...)

Once it has read to the log end of the resume's moment (a client cannot have seen more) and
to the shared reader's position on `tp` (so nothing falls between the two), `read` calls
`attach(replayed)` in that same turn: the caller attaches the stream there, and what the
shared reader reads next goes to it. What both read is dropped by the stream's `seq`
(streams.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import TypeAdapter, ValidationError

from shared.kafka import key_of
from shared.messages import ErrorCode, ResultRecord

log = structlog.get_logger()

_results: TypeAdapter[ResultRecord] = TypeAdapter(ResultRecord)

# Records per fetch of a replay; a replay reads at most `max_records` in all.
FETCH_RECORDS = 2000
FETCH_WAIT_MS = 200
# The broker's wait on a fetch that finds nothing (the consumer's setting): a replay reads
# what is there, so it never waits on an empty one for long.
REPLAY_FETCH_WAIT_MS = 100
SLOW_STOP_S = 1.0  # a replay consumer's stop that takes longer is logged
# Each request of a replay's consumer waits this long at most (aiokafka's default is 40 s):
# a consumer started while a node hangs, or that asks a leader which has since been
# fenced, tries again elsewhere within the replay's bound instead of spending it whole
# (chaos seed 325070550: replays that fetched nothing for 10 s, refused again and again).
REPLAY_REQUEST_TIMEOUT_MS = 3000


class ReplayRefused(Exception):
    """The replay cannot be served: too far back, or too slow; `code` is the client's."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Replayed:
    """The stream's records in `[start, position)`, in order; `scanned`: records read."""

    records: list[ResultRecord]
    position: int
    scanned: int


class Replays:
    """Every replay of this edge: at most `concurrency` at once, each bounded.

    Caller: `Gateway._resume`.
    Affects: nothing shared; each replay's consumer is its own and stopped when it ends.
    """

    def __init__(
        self,
        consumer: Callable[[], AIOKafkaConsumer],
        *,
        timeout_s: float,
        max_records: int,
        concurrency: int,
    ) -> None:
        self._consumer = consumer
        self.timeout_s = timeout_s
        self.max_records = max_records
        self._slots = asyncio.Semaphore(concurrency)

    async def read(
        self,
        tp: TopicPartition,
        request_id: str,
        *,
        start: int,
        end: int,
        live: Callable[[], int | None],
        attach: Callable[[Replayed], None],
    ) -> Replayed:
        """Read `request_id`'s records on `tp` from `start` until the log end `end` and the
        shared reader's position `live()` (None: it does not read `tp`) are both reached,
        then call `attach` with them, before anything else runs on the loop.

        ReplayRefused if that takes more than `max_records` records or `timeout_s`. Only the
        read up to the hand-over is timed: once `attach` ran, the stream is live and the
        replay has succeeded, however long its consumer then takes to stop. (A timeout that
        struck in that stop refused a resume whose stream was already attached: the client
        tried again after the stream's `done`, and was sent an `error` after it. Chaos seed
        603794555, docs/reliability.md finding 12.)
        """
        progress = _Progress(start)
        async with AsyncExitStack() as consumers:  # stopped after, outside the timeout
            try:
                async with asyncio.timeout(self.timeout_s), self._slots:
                    return await self._read(
                        consumers, tp, request_id, start, end, live, attach, progress
                    )
            except TimeoutError:
                log.warning(
                    "replay.timed_out",
                    topic=tp.topic,
                    partition=tp.partition,
                    start=start,
                    end=end,
                    position=progress.position,
                    live=live(),
                    scanned=progress.scanned,
                    started=progress.started,
                )
                raise ReplayRefused(
                    ErrorCode.overloaded,
                    f"stream.resume: the replay did not finish in {self.timeout_s:g} s, try again",
                ) from None

    async def _read(
        self,
        consumers: AsyncExitStack,
        tp: TopicPartition,
        request_id: str,
        start: int,
        end: int,
        live: Callable[[], int | None],
        attach: Callable[[Replayed], None],
        progress: _Progress,
    ) -> Replayed:
        key = key_of(request_id)
        records: list[ResultRecord] = []
        position, scanned = start, 0
        consumer: AIOKafkaConsumer | None = None
        while not _caught_up(position, end, live()):
            if scanned >= self.max_records:
                raise ReplayRefused(
                    ErrorCode.not_found,
                    f"stream.resume: the stream is more than {self.max_records} records"
                    " back; it cannot be replayed",
                )
            if consumer is None:
                started: AIOKafkaConsumer = await consumers.enter_async_context(
                    _started(self._consumer(), tp)
                )
                started.seek(tp, start)
                consumer = started
                progress.started = True
            fetched = await consumer.getmany(
                tp,
                timeout_ms=FETCH_WAIT_MS,
                max_records=min(FETCH_RECORDS, self.max_records - scanned),
            )
            for record in fetched.get(tp, []):
                scanned += 1
                if record.key != key:
                    continue
                try:
                    records.append(_results.validate_json(record.value or b""))
                except ValidationError as exc:
                    log.error(
                        "result.invalid", topic=tp.topic, offset=record.offset, error=str(exc)
                    )
            # Past transaction markers too, which no record shows.
            position = progress.position = await consumer.position(tp)
            progress.scanned = scanned
        # Caught up, and nothing awaited since the check: hand over now (the consumer stops
        # after, in the caller).
        replayed = Replayed(records, position, scanned)
        attach(replayed)
        return replayed


@dataclass
class _Progress:
    """How far a replay got: what its timeout logs."""

    position: int
    scanned: int = 0
    started: bool = False


def _caught_up(position: int, end: int, live: int | None) -> bool:
    return position >= end and (live is None or position >= live)


@asynccontextmanager
async def _started(
    consumer: AIOKafkaConsumer, tp: TopicPartition
) -> AsyncIterator[AIOKafkaConsumer]:
    """`consumer` started and assigned `tp` alone; stopped on exit."""
    await consumer.start()
    try:
        consumer.assign([tp])
        yield consumer
    finally:
        began = time.monotonic()
        try:
            await consumer.stop()
        except KafkaError as exc:  # after the hand-over: the resume has succeeded already
            log.warning("replay.consumer_stop_failed", topic=tp.topic, error=repr(exc))
        if (took := time.monotonic() - began) > SLOW_STOP_S:
            log.warning("replay.consumer_stop_slow", topic=tp.topic, took_s=round(took, 3))
