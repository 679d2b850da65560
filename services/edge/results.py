"""The edge's one Kafka consumer: result partitions it follows, and the control topic.

What it follows changes while it runs (a per-request topic per request, a foreign partition
per resumed stream), so the consumer is touched only by `run`: others ask for changes, and
`run` applies them between fetches. Positions are kept here, not in the consumer, because
aiokafka forgets them on every `assign`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from pydantic import TypeAdapter, ValidationError

from shared.messages import ResultRecord, error_message
from shared.records import read

log = structlog.get_logger()

_results: TypeAdapter[ResultRecord] = TypeAdapter(ResultRecord)

# Records handled per fetch: between two fetches the sockets' writers run, so one fetch
# never queues more than this many frames on a socket (see `edge_outbox_frames`).
FETCH_MAX_RECORDS = 1000

OnCaughtUp = Callable[[], None]


class ResultSink(Protocol):
    """Where the reader hands what it read (the gateway)."""

    def on_fetched(
        self,
        consumer: AIOKafkaConsumer,
        fetched: Mapping[TopicPartition, Sequence[ConsumerRecord[bytes, bytes]]],
    ) -> None:
        """What one fetch returned, before any of it is handed over (lag)."""

    def on_control(self, value: bytes) -> None:
        """One record of the control topic."""

    def wants(self, key: bytes | None) -> bool:
        """Whether a result record of this key is for a stream here: only those are parsed."""

    def on_results(
        self, results: Sequence[tuple[ConsumerRecord[bytes, bytes], ResultRecord]]
    ) -> None:
        """The valid result records of one partition from one fetch, parsed, in order."""


@dataclass(frozen=True)
class _Follow:
    tp: TopicPartition
    offset: int
    caught_up_at: int
    on_caught_up: OnCaughtUp | None


@dataclass(frozen=True)
class _Unfollow:
    tp: TopicPartition


@dataclass
class _Tail:
    """One followed partition: where reading goes on, and who still needs it."""

    position: int
    refs: int = 1
    permanent: bool = False
    # (offset, callback): call once `position` reaches offset
    waiters: list[tuple[int, OnCaughtUp]] = field(default_factory=list)


class ResultReader:
    """Owns the consumer; hands result and control records to a sink (`run`)."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        control: TopicPartition,
        side: Mapping[TopicPartition, Callable[[bytes], None]] | None = None,
    ) -> None:
        self._consumer = consumer
        # Other partitions read for the edge's life, each handed to its own callback
        # (the workers' heartbeats, for `/v1/models`), never parsed as results.
        self._side = dict(side or {})
        self._control = control
        self._tails: dict[TopicPartition, _Tail] = {}
        self._assigned: frozenset[TopicPartition] = frozenset()
        self._ops: list[_Follow | _Unfollow] = []
        # Resolved when a change is asked for; `run` waits on it beside each fetch.
        self._wake: asyncio.Future[None] | None = None

    async def start(self, own: TopicPartition | None, side_since: float | None = None) -> None:
        """Follow the control topic, and `own` (the edge's result partition), from their ends;
        the side partitions from their first record at or after `side_since` (Unix seconds)."""
        permanent = [self._control] + ([own] if own is not None else []) + list(self._side)
        self._consumer.assign(permanent)
        for tp in permanent:
            await self._consumer.seek_to_end(tp)
            position = await self._consumer.position(tp)
            if tp in self._side and side_since is not None:
                found = await self._consumer.offsets_for_times({tp: int(side_since * 1000)})
                if found.get(tp) is not None:
                    position = found[tp].offset
            self._tails[tp] = _Tail(position=position, permanent=True)
        self._assigned = frozenset(permanent)

    def position(self, tp: TopicPartition) -> int | None:
        """The next offset this edge will read on `tp`: a safe start for a resume token."""
        tail = self._tails.get(tp)
        return None if tail is None else tail.position

    def following(self) -> int:
        return len(self._tails)

    async def offsets(self, tp: TopicPartition) -> tuple[int, int]:
        """First offset still stored and end offset (high watermark) of `tp`, now."""
        # Offset look-ups do not touch positions or the fetch buffer: safe beside `run`.
        begin = await self._consumer.beginning_offsets([tp])
        end = await self._consumer.end_offsets([tp])
        return begin[tp], end[tp]

    def follow(
        self,
        tp: TopicPartition,
        offset: int,
        caught_up_at: int | None = None,
        on_caught_up: OnCaughtUp | None = None,
    ) -> None:
        """Read `tp` from `offset` (or from where it is, if that is earlier) until `unfollow`.

        `on_caught_up` is called once reading has passed `caught_up_at` (default `offset`).
        Rewinding a partition others already read re-delivers records to their streams; the
        router drops them as duplicates. Takes effect between two fetches, in order.
        """
        target = offset if caught_up_at is None else caught_up_at
        self._ops.append(_Follow(tp, offset, target, on_caught_up))
        self._poke()

    def join(self, tp: TopicPartition, offset: int) -> None:
        """Read `tp` on from where this reader stands on it, or from `offset` if it does not
        read it yet: never rewound (a resume's replay read the past: `replay.py`).

        Takes effect now, not between fetches: `position(tp)` is this reader's from this
        call on, so the replay that called it leaves no record between the two. Ends with
        `unfollow`, as `follow` does.
        """
        tail = self._tails.get(tp)
        if tail is not None:
            tail.refs += 1
            return
        self._tails[tp] = _Tail(position=offset)
        self._poke()  # `run` assigns it and seeks to `offset` before its next fetch

    def unfollow(self, tp: TopicPartition) -> None:
        self._ops.append(_Unfollow(tp))
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def run(self, sink: ResultSink) -> None:
        """Read until cancelled. Safe to call again after a failure: positions are kept here,
        and the first step assigns and seeks every followed partition afresh."""
        self._assigned = frozenset()
        loop = asyncio.get_running_loop()
        while True:
            # One wake-up future, kept across fetches while no change is asked for (most
            # fetches end with records). Armed before the changes are taken, so a change
            # asked for from here on (even by a sink or a caught-up callback below) wakes it.
            if self._wake is None or self._wake.done():
                self._wake = loop.create_future()
            self._apply_changes()
            self._fire_waiters()
            if self._wake.done():
                continue  # a callback asked for another change: apply it before fetching
            fetch = asyncio.ensure_future(self._fetch(sink))
            try:
                await asyncio.wait({fetch, self._wake}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not fetch.done():
                    fetch.cancel()
            try:
                await fetch
            except asyncio.CancelledError:
                # The reader itself is being cancelled: go. Otherwise the fetch was cancelled
                # here for a change of what to follow; nothing was taken from the consumer's
                # buffer, and positions are ours, so nothing is lost. (Deciding this by
                # whether a change is pending would be wrong: the change may already be
                # applied, and a reader that raised CancelledError would end silently.)
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                continue

    async def _fetch(self, sink: ResultSink) -> None:
        """One fetch, handed to the sink in the turn its records are taken.

        Taking them tells aiokafka's fetcher the buffer is drained, and it builds the next
        fetch request at its next wake-up; records handed on here (not after this task's
        end has woken `run`) queue their sockets' writers ahead of that work (ADR 0042 has
        the measured gain). Nothing here awaits after `getmany`, so a cancel for a change
        of what to follow lands only while nothing has been taken.
        """
        fetched = await self._consumer.getmany(timeout_ms=1000, max_records=FETCH_MAX_RECORDS)
        sink.on_fetched(self._consumer, fetched)
        for tp, records in fetched.items():
            self._handle(tp, records, sink)

    def _apply_changes(self) -> None:
        seeks: set[TopicPartition] = set()
        ops, self._ops = self._ops, []
        for op in ops:
            tail = self._tails.get(op.tp)
            if isinstance(op, _Unfollow):
                if tail is not None and not tail.permanent:
                    tail.refs -= 1
                    if tail.refs <= 0:
                        del self._tails[op.tp]
                continue
            if tail is None:
                tail = self._tails[op.tp] = _Tail(position=op.offset, refs=0)
                seeks.add(op.tp)
            elif op.offset < tail.position:
                tail.position = op.offset
                seeks.add(op.tp)
            tail.refs += 1
            if op.on_caught_up is not None:
                tail.waiters.append((op.caught_up_at, op.on_caught_up))
        wanted = frozenset(self._tails)
        if wanted != self._assigned:
            self._consumer.assign(list(wanted))
            self._assigned = wanted
            seeks = set(wanted)  # assign forgets every position
        for tp in seeks & wanted:
            self._consumer.seek(tp, self._tails[tp].position)

    def _handle(
        self, tp: TopicPartition, records: list[ConsumerRecord[bytes, bytes]], sink: ResultSink
    ) -> None:
        tail = self._tails.get(tp)
        if tail is None or not records:
            return  # unfollowed while these were in flight
        tail.position = records[-1].offset + 1
        if tp == self._control:
            for record in records:
                sink.on_control(record.value or b"")
        elif (handler := self._side.get(tp)) is not None:
            for record in records:
                handler(record.value or b"")
        else:
            parsed: list[tuple[ConsumerRecord[bytes, bytes], ResultRecord]] = []
            # Keyed by request id: a partition followed for one resumed stream carries
            # another edge's whole traffic, none of which is parsed here (issue 37, N8).
            for record in records:
                if not sink.wants(record.key):
                    continue
                try:
                    parsed.append((record, read(_results, record.value or b"")))
                except ValidationError as exc:
                    log.error(
                        "result.invalid",
                        topic=tp.topic,
                        offset=record.offset,
                        error=error_message(exc),
                    )
            if parsed:
                sink.on_results(parsed)
        self._fire_waiters()

    def _fire_waiters(self) -> None:
        for tp, tail in list(self._tails.items()):
            if not tail.waiters:
                continue
            due = [w for w in tail.waiters if tail.position >= w[0]]
            if not due:
                continue
            tail.waiters = [w for w in tail.waiters if tail.position < w[0]]
            for _, callback in due:
                try:
                    callback()
                except Exception:
                    # One stream's bookkeeping must not stop every other stream's records.
                    log.exception("reader.caught_up_failed", topic=tp.topic)
