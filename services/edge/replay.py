"""Resume replays: streams' past records, read by consumers of their own, one per partition.

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

Every resume of one partition shares one consumer (ADR 0061). When an edge dies, its
clients resume a hundred streams of its partition on the others at once; a consumer each
read the same records a hundred times over and starved the machine (chaos seed 294815970:
thousands of resumes refused for three minutes, requests never shown). One `_Partition`
reads from the earliest start among the resumes waiting and hands each its own records;
a resume that comes while it reads joins at once if it starts at or after the position,
or waits for the next round, which seeks back.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import TypeAdapter, ValidationError

from shared.kafka import key_of
from shared.messages import ErrorCode, ResultRecord, error_message
from shared.records import read

log = structlog.get_logger()

_results: TypeAdapter[ResultRecord] = TypeAdapter(ResultRecord)

# Records per fetch of a replay.
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

    def __init__(self, code: ErrorCode, message: str, scanned: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.scanned = scanned  # records it read before it was refused (what it is charged)


@dataclass(frozen=True)
class Replayed:
    """The stream's records in `[start, position)`, in order; `scanned`: records read."""

    records: list[ResultRecord]
    position: int
    scanned: int


@dataclass(eq=False)
class _Resume:
    """One resume waiting on its partition's reader; what its timeout logs, too."""

    key: bytes
    start: int
    end: int
    live: Callable[[], int | None]
    attach: Callable[[Replayed], None]
    done: asyncio.Future[Replayed]
    records: list[ResultRecord] = field(default_factory=list)
    position: int = 0
    scanned: int = 0
    started: bool = False  # its round's consumer had started
    gone: bool = False  # timed out or cancelled: never attached after this


class Replays:
    """Every replay of this edge: one reader per partition, at most `concurrency` at once.

    Caller: `Gateway._resume`.
    Affects: nothing shared; each partition's consumer is its own and stopped once no
    resume waits on it.
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
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._tasks: set[asyncio.Task[None]] = set()

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
        if _caught_up(start, end, live()):  # nothing to read: no consumer at all
            replayed = Replayed([], start, 0)
            attach(replayed)
            return replayed
        resume = _Resume(
            key_of(request_id), start, end, live, attach, asyncio.get_running_loop().create_future()
        )
        resume.position = start
        self._partition(tp).add(resume)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.shield(resume.done)
        except TimeoutError:
            if resume.done.done() and not resume.done.cancelled():
                return resume.done.result()  # attached, or refused, in the timeout's turn
            resume.gone = True
            log.warning(
                "replay.timed_out",
                topic=tp.topic,
                partition=tp.partition,
                start=start,
                end=end,
                position=resume.position,
                live=live(),
                scanned=resume.scanned,
                started=resume.started,
            )
            raise ReplayRefused(
                ErrorCode.overloaded,
                f"stream.resume: the replay did not finish in {self.timeout_s:g} s, try again",
                resume.scanned,
            ) from None
        except BaseException:
            resume.gone = True  # cancelled: the partition's reader drops it
            raise

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Let every partition's reader end (each does once its resumes are served or gone)
        and stop its consumer; cancel what is left after `timeout_s`."""
        tasks = set(self._tasks)
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=timeout_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    def _partition(self, tp: TopicPartition) -> _Partition:
        partition = self._partitions.get(tp)
        if partition is None or partition.closed:
            partition = _Partition(tp, self._consumer, self.max_records)
            self._partitions[tp] = partition
            task = asyncio.create_task(
                self._run(partition), name=f"replay-{tp.topic}-{tp.partition}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return partition

    async def _run(self, partition: _Partition) -> None:
        try:
            async with self._slots:
                await partition.run()
        except asyncio.CancelledError as exc:  # the edge stops
            partition.fail(exc)
            raise
        except Exception as exc:
            partition.fail(exc)
            if not isinstance(exc, KafkaError):
                log.exception("replay.failed", topic=partition.tp.topic)
        finally:
            if self._partitions.get(partition.tp) is partition:
                del self._partitions[partition.tp]


class _Partition:
    """The reader of one partition's replays: rounds, each from the earliest start waiting,
    until no resume waits; then its consumer stops."""

    def __init__(
        self, tp: TopicPartition, consumer: Callable[[], AIOKafkaConsumer], max_records: int
    ) -> None:
        self.tp = tp
        self._consumer = consumer
        self._max_records = max_records
        self._waiting: list[_Resume] = []  # for the next round
        self._reading: dict[bytes, list[_Resume]] = {}  # this round's, by key
        self._position: int | None = None  # this round's next offset; None between rounds
        self.closed = False

    def add(self, resume: _Resume) -> None:
        """Serve `resume`: in this round if it starts at or after where the round stands."""
        if self._position is not None and resume.start >= self._position:
            resume.started = True
            self._reading.setdefault(resume.key, []).append(resume)
        else:
            self._waiting.append(resume)

    def fail(self, exc: BaseException) -> None:
        """The reader ended on `exc`: every resume still waiting gets it."""
        self.closed = True
        failure = exc if isinstance(exc, KafkaError) else KafkaError(repr(exc))
        for resume in self._waiting + [r for rs in self._reading.values() for r in rs]:
            if not resume.done.done():
                resume.done.set_exception(failure)
        self._waiting.clear()
        self._reading.clear()

    async def run(self) -> None:
        async with AsyncExitStack() as consumers:  # stopped after the last round
            consumer: AIOKafkaConsumer | None = None
            while waiting := [r for r in self._waiting if not r.gone]:
                self._waiting = []
                if consumer is None:
                    consumer = await consumers.enter_async_context(
                        _started(self._consumer(), self.tp)
                    )
                await self._round(consumer, waiting)
            self.closed = True  # in the turn that found none waiting: later ones start anew

    async def _round(self, consumer: AIOKafkaConsumer, resumes: list[_Resume]) -> None:
        """Read from the earliest start until every resume of the round is served or gone."""
        position = min(r.start for r in resumes)
        consumer.seek(self.tp, position)
        self._position = position
        self._reading = {}
        for resume in resumes:
            resume.started = True
            self._reading.setdefault(resume.key, []).append(resume)
        try:
            while self._settle(position):
                fetched = await consumer.getmany(
                    self.tp, timeout_ms=FETCH_WAIT_MS, max_records=self._fetch_size()
                )
                batch = fetched.get(self.tp, [])
                self._deal(batch)
                if batch:  # every record before it is dealt: a resume from there misses none
                    self._position = batch[-1].offset + 1
                # Past transaction markers too, which no record shows.
                position = self._position = await consumer.position(self.tp)
        finally:
            self._position = None
            self._waiting.extend(r for rs in self._reading.values() for r in rs)
            self._reading = {}

    def _fetch_size(self) -> int:
        """Records the next fetch may bring: no resume reads past its `max_records`."""
        budget = min(
            (self._max_records - r.scanned for rs in self._reading.values() for r in rs),
            default=FETCH_RECORDS,
        )
        return max(1, min(FETCH_RECORDS, budget))

    def _deal(self, batch: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        """Records read, in offset order: counted for every resume they are past the start
        of, each kept by the resumes of its key."""
        if not batch:
            return
        offsets = [record.offset for record in batch]
        for resumes in self._reading.values():
            for resume in resumes:
                resume.scanned += len(offsets) - bisect.bisect_left(offsets, resume.start)
        for record in batch:
            mine = [r for r in self._reading.get(record.key or b"", ()) if record.offset >= r.start]
            if not mine:
                continue
            try:
                result = read(_results, record.value or b"")
            except ValidationError as exc:
                log.error(
                    "result.invalid",
                    topic=self.tp.topic,
                    offset=record.offset,
                    error=error_message(exc),
                )
                continue
            for resume in mine:
                resume.records.append(result)

    def _settle(self, position: int) -> bool:
        """Hand over every resume caught up at `position`, refuse those too far back, drop
        those gone; True while some are left to read for. No await: each hand-over happens
        in the turn its check passed."""
        left: dict[bytes, list[_Resume]] = {}
        for key, resumes in self._reading.items():
            for resume in resumes:
                resume.position = position
                if resume.gone or resume.done.done():
                    continue
                if _caught_up(position, resume.end, resume.live()):
                    replayed = Replayed(resume.records, position, resume.scanned)
                    resume.attach(replayed)
                    resume.done.set_result(replayed)
                elif resume.scanned >= self._max_records:
                    resume.done.set_exception(
                        ReplayRefused(
                            ErrorCode.not_found,
                            f"stream.resume: the stream is more than {self._max_records}"
                            " records back; it cannot be replayed",
                            resume.scanned,
                        )
                    )
                else:
                    left.setdefault(key, []).append(resume)
        self._reading = left
        return bool(left)


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
