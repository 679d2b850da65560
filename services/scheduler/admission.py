"""Whether a tier record joins the backlog: the scheduler's admission, a step that decides.

Beside `Policy.plan`: the shell reads a record, asks `Admission.decide`, and carries out
the decision (queue it, answer it, skip it, or dead-letter it). No Kafka and no clock of
its own; the only state is what admission must remember to drop a second copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from pydantic import ValidationError

from services.scheduler.limits import PolicyConfig
from shared.dead_letters import Addressed, read_address
from shared.messages import ErrorCode, ErrorResult, QueuedRequest, RequestLimits, error_message
from shared.records import read

SEEN_MEMORY = 200_000  # (request_id, attempt) remembered per partition to drop a second copy
DISPATCHED_MEMORY_S = 600.0  # how long restart-scan findings are kept
TRACE_HEADERS = ("traceparent", "tracestate")
TRACEPARENT_CHARS = 55  # version-trace_id-parent_id-flags

Attempt = tuple[str, int]  # (request_id, attempt)
Copy = tuple[str, int, int]  # (request_id, attempt, requeued)


@dataclass(frozen=True)
class _Seen:
    requeued: int  # the copy's count (QueuedRequest.requeued)
    here: bool  # read by this process (False: remembered from the partition's history)


@dataclass(frozen=True)
class Waiting:
    """A request in the backlog, and the tier-topic record it came from."""

    request: QueuedRequest
    tp: TopicPartition
    offset: int


@dataclass(frozen=True)
class Queue:
    """Into the backlog."""

    waiting: Waiting


@dataclass(frozen=True)
class Answer:
    """Answered now with an error (it can never ride, or its deadline passed)."""

    waiting: Waiting
    error: ErrorResult
    expired: bool = False


@dataclass(frozen=True)
class Skip:
    """Handed on already (a second hand-back, or dispatched by the partition's last owner)."""

    tp: TopicPartition
    offset: int
    request_id: str
    why: Literal["duplicate", "already_dispatched"]


@dataclass(frozen=True)
class Poison:
    """A tier record that is not a request: dead-lettered, answered if it has an address."""

    tp: TopicPartition
    record: ConsumerRecord[bytes, bytes]
    reason: str
    address: Addressed | None


Decision = Queue | Answer | Skip | Poison


class Admission:
    """Decides each tier record once; remembers what it let in, per partition.

    Caller: the scheduler's tier reader (`decide`), its rebalance (`released`,
    `dispatched_before`). Affects: only its own memory.
    """

    def __init__(self, config: PolicyConfig, output_estimate: int | None = None) -> None:
        self.config = config
        # Records are read with the output estimate of an unset max_tokens
        # (TOKENBUS_DEFAULT_MAX_TOKENS): what their batch budgets and fair share charge
        # (ADR 0051); None: the default's.
        limits = RequestLimits()
        if output_estimate is not None:
            limits = RequestLimits(default_max_tokens=output_estimate)
        self._context = {"limits": limits}
        # Per tier partition we own, the (request_id, attempt) read from it, and which copy.
        self._seen: dict[TopicPartition, OrderedDict[Attempt, _Seen]] = {}
        # Copies this process wrote to a partition's tail (requeue.py), not yet read back.
        self._moved: dict[TopicPartition, dict[Attempt, int]] = {}
        self._dispatched_before: dict[Attempt, float] = {}  # found by restart scans

    def decide(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], now: float
    ) -> Decision:
        """The decision for one record, read at `now` (Unix seconds)."""
        value = record.value or b""
        try:
            request = read(QueuedRequest, value, context=self._context)
        except ValidationError as exc:
            # Ingest and recovery write tier topics, but so can anyone with access.
            return Poison(tp, record, error_message(exc), read_address(value))
        key = (request.request_id, request.attempt)
        seen = self._seen.setdefault(tp, OrderedDict())
        if self._moved.get(tp, {}).get(key) == request.requeued:
            del self._moved[tp][key]  # the request this process moved to the tail
        elif (prior := seen.get(key)) is not None and (
            prior.requeued == request.requeued or prior.here
        ):
            # Handed back twice (a recovery redone after a crash), or a copy moved to the
            # tail by a scheduler that crashed before committing the move, beside the
            # record it copied, read here too: one run is enough.
            return Skip(tp, record.offset, request.request_id, "duplicate")
        seen[key] = _Seen(request.requeued, here=True)
        seen.move_to_end(key)
        if len(seen) > SEEN_MEMORY:
            seen.popitem(last=False)
        if self._dispatched_before.pop(key, None) is not None:
            return Skip(tp, record.offset, request.request_id, "already_dispatched")
        # The record's trace headers win; a record without them (a request handed back by
        # a worker) keeps the context already in its `trace` field.
        trace = trace_of(record.headers)
        if trace:
            request = request.model_copy(update={"trace": trace})
        waiting = Waiting(request, tp, record.offset)
        budget = self.config.tiers[request.tier].max_batch_tokens
        if request.token_cost > budget:
            message = f"{request.token_cost} tokens is above the {request.tier} budget of {budget}"
            error = ErrorResult.for_request(request, ErrorCode.invalid_request, message)
            return Answer(waiting, error)
        deadline = request.deadline_at
        if deadline is not None and deadline <= now:
            return Answer(waiting, deadline_error(request), expired=True)
        return Queue(waiting)

    def remember(self, recent: Mapping[TopicPartition, Iterable[Copy]]) -> None:
        """Copies a partition held just before its last commit (a take-over's history read).

        Only the same copy is dropped after it: a record moved to the tail is found there
        under its next count, and is the request, not a second copy of it."""
        for tp, copies in recent.items():
            seen = self._seen.setdefault(tp, OrderedDict())
            for request_id, attempt, requeued in copies:
                if (prior := seen.get((request_id, attempt))) is None or not prior.here:
                    seen[(request_id, attempt)] = _Seen(requeued, here=False)
            while len(seen) > SEEN_MEMORY:
                seen.popitem(last=False)

    def released(self, waiting: Iterable[Waiting]) -> None:
        """Requests given up unsent (their partition moved): their new owner reads them anew.

        The rest of the memory is kept (bounded): a partition that comes back after a
        rebalance still drops a second hand-back of an attempt it has handed on.
        """
        for w in waiting:
            self._seen.get(w.tp, OrderedDict()).pop((w.request.request_id, w.request.attempt), None)

    def moved(self, w: Waiting) -> None:
        """`w` was written to its partition's tail as `w.request.requeued + 1` (requeue.py):
        that copy is let in when read back, as no other copy of the request is."""
        key = (w.request.request_id, w.request.attempt)
        self._moved.setdefault(w.tp, {})[key] = w.request.requeued + 1

    def dispatched_before(self, found: Iterable[Attempt], now: float) -> None:
        """Attempts a restart scan found in the batches topic: skipped when read again."""
        for old in [k for k, t in self._dispatched_before.items() if now - t > DISPATCHED_MEMORY_S]:
            del self._dispatched_before[old]
        for key in found:
            self._dispatched_before[key] = now


def deadline_error(request: QueuedRequest) -> ErrorResult:
    message = f"deadline of {request.deadline_ms} ms passed while queued"
    return ErrorResult.for_request(request, ErrorCode.deadline_exceeded, message)


def trace_of(headers: Sequence[tuple[str, bytes]] | None) -> dict[str, str]:
    """The W3C trace headers of a record, as the `trace` field carries them; empty unless
    it has a `traceparent` of the W3C length (read as text, not parsed: the tracer does)."""
    found: dict[str, str] = {}
    for name, value in headers or ():
        if name in TRACE_HEADERS and value is not None:
            found[name] = value.decode("latin-1")
    if len(found.get("traceparent", "")) != TRACEPARENT_CHARS:
        return {}
    return found


def unserved_error(request: QueuedRequest, model: str | None, variant: str | None) -> ErrorResult:
    """A request whose model (or pinned variant) no live worker has served for the
    scheduler's unserved hold (models.py `unserved`): answered, not held for ever."""
    what = f"model {model!r}" if model is not None else "any model"
    if variant is not None:
        what += f", variant {variant!r}"
    message = f"no live worker has served {what} for the scheduler's unserved hold"
    return ErrorResult.for_request(request, ErrorCode.overloaded, message)
