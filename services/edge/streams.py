"""Routes result records to the streams they belong to: drops duplicates, announces attempts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.edge.protocol import DeltaFrame, DoneFrame, ErrorFrame, ResetFrame, ServerFrame
from shared.messages import DeltaResult, DoneResult, ErrorResult

Deliver = Callable[[ServerFrame], None]


@dataclass
class ResultStream:
    """One request's stream to one socket: the attempt shown and the next `seq` expected."""

    request_id: str
    deliver: Deliver
    owner: object
    attempt: int = 0
    next_seq: int = 0
    held: list[ServerFrame] | None = field(default_factory=list)

    def emit(self, frame: ServerFrame) -> None:
        if self.held is not None:  # not yet accepted: keep order behind `chat.accepted`
            self.held.append(frame)
        else:
            self.deliver(frame)


class StreamRouter:
    """request_id -> stream. Pure: no I/O, so the framing rules are tested with plain values."""

    def __init__(self) -> None:
        self._streams: dict[str, ResultStream] = {}

    def open(self, request_id: str, deliver: Deliver, owner: object) -> ResultStream:
        stream = ResultStream(request_id, deliver, owner)
        self._streams[request_id] = stream
        return stream

    def release(self, request_id: str, first: ServerFrame) -> None:
        """Deliver `first` (the acceptance), then whatever arrived before it."""
        stream = self._streams.get(request_id)
        if stream is None or stream.held is None:
            return
        held, stream.held = stream.held, None
        stream.deliver(first)
        for frame in held:
            stream.deliver(frame)
        if any(isinstance(f, DoneFrame | ErrorFrame) for f in held):
            self.close(request_id)

    def get(self, request_id: str) -> ResultStream | None:
        return self._streams.get(request_id)

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def close_owner(self, owner: object) -> list[str]:
        """Forget every stream of one socket; return their request ids."""
        gone = [rid for rid, s in self._streams.items() if s.owner is owner]
        for rid in gone:
            del self._streams[rid]
        return gone

    def route(self, record: DeltaResult | DoneResult | ErrorResult) -> bool:
        """Show a record on its stream; False if it is not shown (unknown, stale, duplicate)."""
        stream = self._streams.get(record.request_id)
        if stream is None or record.attempt < stream.attempt:
            return False
        if record.attempt > stream.attempt:
            stream.attempt = record.attempt
            stream.next_seq = 0
            stream.emit(ResetFrame(request_id=record.request_id, attempt=record.attempt))
        if record.seq < stream.next_seq:
            return False
        stream.next_seq = record.seq + 1
        if isinstance(record, DeltaResult):
            stream.emit(DeltaFrame(request_id=record.request_id, seq=record.seq, text=record.text))
            return True
        if isinstance(record, DoneResult):
            stream.emit(
                DoneFrame(
                    request_id=record.request_id,
                    finish_reason=record.finish_reason,
                    usage=record.usage,
                    timings=record.timings,
                )
            )
        else:
            stream.emit(
                ErrorFrame(code=record.code, message=record.message, request_id=record.request_id)
            )
        if stream.held is None:
            self.close(record.request_id)
        return True

    def __len__(self) -> int:
        return len(self._streams)
