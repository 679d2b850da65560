"""Routes result records to the streams they belong to: drops duplicates, announces attempts.

Pure: no I/O and no clock, so every framing rule is tested with plain values. The rules:
- a record of an older attempt than the newest read is dropped;
- a `reset` record only announces its attempt (so later records of older ones are dropped);
- a newer attempt that continues the answer shown (its first delta's text begins with all
  the text shown: a continuation's worker writes the text so far first, ADR 0071) is shown
  as the same answer going on: only its text past what was shown, under the same shown
  attempt, `seq` counting on. One that does not (it starts over) is preceded by
  `chat.reset` and its `seq` restarts; an error as its first record just ends the stream;
- a record whose `seq` was already read (a replay, a duplicate) is dropped;
- the first final record (`done` or `error`) ends the stream: nothing after it is shown,
  a re-run's `reset` included (ADR 0055);
- a record that would leave a hole in `seq` ends the stream with an error: a client is told
  the stream cannot be recovered, never shown a stream with a gap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from aiokafka import TopicPartition

from services.edge.protocol import (
    DeltaFrame,
    DoneFrame,
    ErrorFrame,
    ResetFrame,
    ServerFrame,
    StreamResumedFrame,
)
from shared.messages import DeltaResult, DoneResult, ErrorCode, ErrorResult, ResetResult, Usage

if TYPE_CHECKING:
    from services.edge.telemetry import InFlight

Result = DeltaResult | DoneResult | ErrorResult | ResetResult


class Client(Protocol):
    """Where a stream's frames go: a WebSocket's outbox, an HTTP response.

    `send` never waits (the edge's one result reader calls it); `stream` is the stream the
    frame belongs to (None: an answer to the client itself), for the writer to report the
    frame written (`Gateway.written`).
    """

    def send(self, frame: ServerFrame, stream: ResultStream | None = None) -> None: ...

    def drain(self) -> None:
        """The edge is restarting: let go of this client's streams so that it goes on at
        another edge (a socket closes 1012, an SSE stream ends with where to resume, a whole
        answer is refused 503 and its request cancelled). Never waits."""


@dataclass
class ResumePoint:
    """What a resuming client says it has seen, and what the replayed log shows of it.

    Positions are as shown to clients (the shown attempt, the delta frame's `seq`), which
    the replay rebuilds from the stream's first record with the same rules. A client can
    only have seen what was in the log before it resumed, so once the replay has read up
    to the log end of that moment, a claim beyond what was read is false.
    """

    attempt: int
    after_seq: int
    # shown attempt -> highest delta frame seq shown of it (-1: the attempt shown, no delta)
    seen: dict[int, int] = field(default_factory=dict)

    def observe(self, attempt: int, seq: int = -1) -> None:
        self.seen[attempt] = max(self.seen.get(attempt, -1), seq)

    def ahead_of_log(self) -> bool:
        """True if the client claims an attempt or a delta the log never had."""
        if self.attempt == 0 and self.after_seq < 0:
            return False  # claims nothing
        if self.attempt not in self.seen:
            return True
        return self.seen[self.attempt] < self.after_seq

    def covers(self, shown_attempt: int, frame: ServerFrame) -> bool:
        """Whether the client has seen `frame`, of shown attempt `shown_attempt`, already."""
        if isinstance(frame, ResetFrame):
            return frame.attempt <= self.attempt
        if isinstance(frame, DeltaFrame):
            return (shown_attempt, frame.seq) <= (self.attempt, self.after_seq)
        return False


class Shown:
    """The text of the answer as shown so far, as a length and a digest: what a new attempt's
    first delta must begin with to continue it (a fixed few bytes a stream, not its text)."""

    __slots__ = ("_digest", "chars")

    def __init__(self) -> None:
        self.chars = 0
        self._digest = hashlib.blake2b(digest_size=16)

    def add(self, text: str) -> None:
        if text:
            self.chars += len(text)
            self._digest.update(text.encode())

    def begins(self, text: str) -> bool:
        """Whether `text` begins with everything shown."""
        if len(text) < self.chars:
            return False
        head = hashlib.blake2b(text[: self.chars].encode(), digest_size=16)
        return head.digest() == self._digest.digest()


@dataclass(eq=False)
class ResultStream:
    """One request at this edge: everything the edge keeps for it, in one object.

    The framing state (the attempt shown, the next `seq` expected, frames held until the
    acceptance), the client it is shown to (None: detached, waiting for a resume), the
    partition read for it alone, its trace, when it last made progress, and when its
    disconnect grace ends. Forgetting a request is one `pop` from the router.
    """

    request_id: str
    client: Client | None
    attempt: int = 0  # the newest attempt read
    next_seq: int = 0  # the next `seq` of it to read
    # Whether `attempt`'s first record, still to come, decides if it continues what is shown.
    deciding: bool = False
    shown_attempt: int = 0  # the attempt the client is shown (a continuation keeps it)
    shown_seq: int = 0  # the next delta frame's `seq`
    shown: Shown = field(default_factory=Shown)
    held: list[ServerFrame] | None = field(default_factory=list)
    resume: ResumePoint | None = None
    ended: bool = False  # its final frame is emitted; nothing more is shown
    followed: TopicPartition | None = None  # a partition read for this request alone
    flight: InFlight | None = None  # its trace and latency clocks (telemetry.py)
    progress_at: float | None = None  # last record seen (None: not watched for stalls)
    grace_until: float | None = None  # detached: cancelled at this time unless resumed
    usage: Usage | None = None  # its final `done`'s real usage: the quota is settled with it
    # Attempt -> what the attempt before it used, where a cascade declined that attempt's
    # answer (its reset says): charged beside the final's (issue 37, N5). Keyed by attempt,
    # so a reset read twice counts once.
    declined: dict[int, Usage] = field(default_factory=dict)
    cancelled: bool = False  # the client's cancel was sent: another one is a no-op
    # Cancelled after its disconnect grace: kept (detached) until its final brings the
    # usage its tenant's charge is settled with, or until its grace runs out a second time.
    abandoned: bool = False
    # Its `done` names the variant that answered: the request pinned it (a key with the
    # pin_variant scope), or the edge names variants to all (`edge_name_variants`). Else a
    # rollout's canary stays unknown to the tenants it serves, who could find its answers
    # and fail them (issue 37, N7).
    names_variant: bool = False

    @property
    def detached(self) -> bool:
        return self.client is None

    @property
    def spent(self) -> Usage | None:
        """What its tenant is charged when it ends: its final's usage and every declined
        attempt's; None while its final has said nothing (the charge stands)."""
        if self.usage is None:
            return None
        return Usage(
            prompt_tokens=self.usage.prompt_tokens
            + sum(u.prompt_tokens for u in self.declined.values()),
            completion_tokens=self.usage.completion_tokens
            + sum(u.completion_tokens for u in self.declined.values()),
        )

    def emit(self, frame: ServerFrame) -> None:
        if self.resume is not None:
            if isinstance(frame, DeltaFrame):
                self.resume.observe(self.shown_attempt, frame.seq)
            elif isinstance(frame, ResetFrame):
                self.resume.observe(frame.attempt)
            if self.resume.covers(self.shown_attempt, frame):
                return  # shown before the client resumed
        if self.held is not None:  # not yet accepted / caught up: keep order behind it
            self.held.append(frame)
        elif self.client is not None:  # a detached stream's frames are not shown
            self.client.send(frame, self)


class StreamRouter:
    """request_id -> stream.

    `on_end` is called once for a stream that ended by its own final record (done or error),
    after that record was delivered, so the edge can release what the stream held.
    """

    def __init__(self, on_end: Callable[[ResultStream], None] | None = None) -> None:
        self._streams: dict[str, ResultStream] = {}
        self._on_end = on_end

    def open(
        self,
        request_id: str,
        client: Client,
        *,
        followed: TopicPartition | None = None,
        flight: InFlight | None = None,
        names_variant: bool = False,
    ) -> ResultStream:
        """A new request's stream; its frames wait for `release` (the `chat.accepted`)."""
        stream = ResultStream(
            request_id, client, followed=followed, flight=flight, names_variant=names_variant
        )
        self._streams[request_id] = stream
        return stream

    def resume(
        self,
        request_id: str,
        client: Client,
        point: ResumePoint,
        *,
        followed: TopicPartition | None = None,
        flight: InFlight | None = None,
        names_variant: bool = False,
    ) -> ResultStream:
        """A resumed stream: shows what follows `point`; held until `caught_up`.

        Its records are replayed from the stream's first, so the answer shown is rebuilt as
        the client saw it (a continuation's text included) and only what follows `point`
        is delivered. Replaces any stream of the same request on this edge: the resuming
        socket is now the one the client reads.
        """
        stream = ResultStream(
            request_id,
            client,
            resume=point,
            followed=followed,
            flight=flight,
            names_variant=names_variant,
        )
        self._streams[request_id] = stream
        return stream

    def release(self, request_id: str, first: ServerFrame) -> None:
        """Deliver `first` (the acceptance), then whatever arrived before it."""
        stream = self._streams.get(request_id)
        if stream is None or stream.held is None:
            return
        held, stream.held = stream.held, None
        stream.emit(first)
        for frame in held:
            stream.emit(frame)
        if any(isinstance(f, DoneFrame | ErrorFrame) for f in held):
            self._end(stream)

    def caught_up(self, request_id: str) -> bool:
        """The replay of a resumed stream reached the log end of its resume: check the claim.

        True: the stream goes on (held frames delivered). False: the client claimed more than
        the log holds; it gets `invalid_request` and the stream is closed.
        """
        stream = self._streams.get(request_id)
        if stream is None or stream.resume is None or stream.held is None:
            return stream is not None
        point = stream.resume
        if point.ahead_of_log():
            stream.held = None
            stream.emit(
                ErrorFrame(
                    code=ErrorCode.invalid_request,
                    message=(
                        f"stream.resume: after_seq {point.after_seq} of attempt {point.attempt}"
                        " is beyond what the stream has sent"
                    ),
                    request_id=request_id,
                )
            )
            self.close(request_id)
            return False
        self.release(
            request_id,
            StreamResumedFrame(
                request_id=request_id, attempt=point.attempt, after_seq=point.after_seq
            ),
        )
        return True

    def get(self, request_id: str) -> ResultStream | None:
        return self._streams.get(request_id)

    def close(self, request_id: str) -> ResultStream | None:
        """Forget a stream without delivering anything more."""
        return self._streams.pop(request_id, None)

    def detach(self, client: Client) -> list[ResultStream]:
        """A client went away: keep its streams, showing nothing, until resumed or cancelled.

        They still follow the records (so a stream that ends meanwhile is known to have
        ended); return them.
        """
        gone = [s for s in self._streams.values() if s.client is client]
        for stream in gone:
            stream.client = None
            stream.held = None
        return gone

    def route(self, record: Result) -> bool:
        """Show a record on its stream; False if it is not shown (unknown, stale, duplicate)."""
        stream = self._streams.get(record.request_id)
        if stream is None or stream.ended:
            return False
        if isinstance(record, ResetResult) and record.usage is not None:
            stream.declined[record.attempt] = record.usage
        if record.attempt < stream.attempt:
            return False
        if record.attempt > stream.attempt:
            stream.attempt = record.attempt
            stream.next_seq = 0
            stream.deciding = True
        if isinstance(record, ResetResult):
            return False  # it announces its attempt; that attempt's first record decides
        if record.seq < stream.next_seq:
            return False
        if record.seq > stream.next_seq:
            # Records of one attempt are written in order to one partition by an idempotent
            # producer, so a hole means records were lost (truncated log, foreign writer).
            stream.emit(
                ErrorFrame(
                    code=ErrorCode.not_found,
                    message=(
                        f"stream: seq {stream.next_seq} of attempt {stream.attempt} is missing;"
                        " the stream cannot be recovered"
                    ),
                    request_id=record.request_id,
                )
            )
            self._finish(stream)
            return False
        stream.next_seq = record.seq + 1
        skip = 0  # characters of the delta the client was shown already
        if stream.deciding:
            stream.deciding = False
            if isinstance(record, DeltaResult) and stream.shown.begins(record.text):
                skip = stream.shown.chars  # it continues the answer shown
            elif not isinstance(record, ErrorResult) and (stream.shown.chars or stream.shown_seq):
                stream.shown_attempt, stream.shown_seq, stream.shown = record.attempt, 0, Shown()
                stream.emit(ResetFrame(request_id=record.request_id, attempt=record.attempt))
        if isinstance(record, DeltaResult):
            text = record.text[skip:]
            if skip and not text:
                return False  # all of it was shown
            stream.shown.add(text)
            stream.emit(
                DeltaFrame(
                    request_id=record.request_id,
                    seq=stream.shown_seq,
                    text=text,
                    # A continuation's text so far has no logprobs: the first attempt's
                    # deltas carried them.
                    logprobs=None if skip else record.logprobs,
                    tokens=record.tokens,
                    prompt_tokens=record.prompt_tokens,
                )
            )
            stream.shown_seq += 1
            return True
        if isinstance(record, DoneResult):
            stream.usage = record.usage
            stream.emit(
                DoneFrame(
                    request_id=record.request_id,
                    finish_reason=record.finish_reason,
                    usage=record.usage,
                    timings=record.timings,
                    model=record.model,
                    cached=record.cached,
                    tool_calls=record.tool_calls,
                    content=record.content,
                    variant=record.variant if stream.names_variant else None,
                )
            )
        else:
            stream.usage = record.usage  # a cancelled run's, where the worker said
            stream.emit(
                ErrorFrame(
                    code=record.code,
                    message=record.message,
                    request_id=record.request_id,
                    retry_after_ms=record.retry_after_ms,
                )
            )
        self._finish(stream)
        return True

    def _finish(self, stream: ResultStream) -> None:
        stream.ended = True
        # A held stream ends when it is released: its final frame is still queued behind it.
        if stream.held is None:
            self._end(stream)

    def _end(self, stream: ResultStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if self._on_end is not None:
                self._on_end(stream)

    def request_ids(self) -> list[str]:
        return list(self._streams)

    def __iter__(self) -> Iterator[ResultStream]:
        return iter(list(self._streams.values()))

    def __len__(self) -> int:
        return len(self._streams)
