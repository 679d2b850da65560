"""What one request's stream has shown the caller, and what a frame from the edge adds to it.

Pure: no I/O and no clock, so each rule is tested with plain values (tests/test_client_framing.py).
The edge numbers deltas by `seq` from 0 within an attempt; a re-run (its worker died) is
announced by `chat.reset {attempt}` and `seq` starts again. A client that lost its socket
resumes with the attempt and the last `seq` it showed, on any edge. The rules here:
- a delta whose `seq` was already shown (a replay after a resume) is dropped;
- a delta that would leave a hole in `seq` is a broken stream: `StreamBroken`, never shown;
- `chat.reset` of a newer attempt is shown as a `Delta` with `reset=True` (drop the text so
  far), and `seq` starts again; a reset of an attempt already shown changes nothing;
- `stream.resumed` must name the point the client resumed from;
- `overloaded` in answer to a resume (Kafka away) is `ResumeLater`, not the stream's end;
- nothing is shown after the stream's final frame (`chat.done` or `error`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from services.edge.protocol import (
    AcceptedFrame,
    DeltaFrame,
    DoneFrame,
    ErrorFrame,
    ResetFrame,
    StreamResumedFrame,
)
from shared.messages import ErrorCode
from shared.records import read

Frame = Annotated[
    AcceptedFrame | DeltaFrame | ResetFrame | DoneFrame | ErrorFrame | StreamResumedFrame,
    Field(discriminator="type"),
]
_frames: TypeAdapter[Frame] = TypeAdapter(Frame)


def parse_frame(data: str | bytes) -> Frame:
    """A server frame, checked against the edge's own protocol models; fields a newer edge
    added are ignored (ADR 0072)."""
    return read(_frames, data)


class StreamBroken(Exception):
    """The edge sent something a correct stream never holds; the stream cannot go on."""


class ResumeLater(Exception):
    """The edge could not read the stream to resume it now (Kafka away): resume again later."""

    def __init__(self, retry_after_ms: int | None) -> None:
        super().__init__(f"resume again in {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True)
class Delta:
    """A piece of the answer. `reset=True`: the request is being run again (`attempt`); drop
    the text shown so far (a reset carries no text; the new attempt's deltas follow)."""

    text: str
    attempt: int
    seq: int
    reset: bool = False


@dataclass
class StreamState:
    """One request, as far as the caller has been shown it."""

    client_id: str
    request_id: str | None = None
    resume_token: str | None = None
    attempt: int = 0
    last_seq: int = -1  # the last delta shown of `attempt`; -1: none yet
    text: str = ""  # the current attempt's text so far
    end: DoneFrame | ErrorFrame | None = None
    resuming: bool = False  # a `stream.resume` was sent; `stream.resumed` is due
    shown: list[tuple[int, int]] = field(default_factory=list)  # (attempt, seq) in order

    @property
    def accepted(self) -> bool:
        return self.resume_token is not None

    @property
    def finished(self) -> bool:
        return self.end is not None

    def request_frame(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"type": "chat.request", "client_id": self.client_id, **body}

    def resume_frame(self) -> dict[str, Any]:
        """What to send on a new socket to go on from what was shown."""
        if self.resume_token is None:
            raise ValueError("not accepted yet: there is nothing to resume")
        self.resuming = True
        return {
            "type": "stream.resume",
            "resume_token": self.resume_token,
            "after_seq": self.last_seq,
            "attempt": self.attempt,
        }

    def cancel_frame(self) -> dict[str, Any] | None:
        if self.request_id is None:
            return None
        return {"type": "chat.cancel", "request_id": self.request_id}

    def receive(self, frame: Frame) -> Delta | None:
        """Apply one frame of this stream; the delta to show, if any.

        Frames of other requests must not be passed (see `concerns`).
        """
        if self.end is not None:
            return None
        if isinstance(frame, AcceptedFrame):
            if self.request_id is None:
                self.request_id, self.resume_token = frame.request_id, frame.resume_token
            return None
        if isinstance(frame, StreamResumedFrame):
            if (frame.attempt, frame.after_seq) != (self.attempt, self.last_seq):
                raise StreamBroken(
                    f"stream.resumed at attempt {frame.attempt} seq {frame.after_seq}, resumed"
                    f" from attempt {self.attempt} seq {self.last_seq}"
                )
            self.resuming = False
            return None
        if isinstance(frame, ResetFrame):
            if frame.attempt <= self.attempt:
                return None
            self.attempt, self.last_seq, self.text = frame.attempt, -1, ""
            return Delta("", frame.attempt, -1, reset=True)
        if isinstance(frame, DeltaFrame):
            if frame.seq <= self.last_seq:
                return None  # shown already: a replay
            if frame.seq > self.last_seq + 1:
                raise StreamBroken(
                    f"seq {frame.seq} of attempt {self.attempt} after seq {self.last_seq}:"
                    " deltas are missing"
                )
            self.last_seq = frame.seq
            self.text += frame.text
            self.shown.append((self.attempt, frame.seq))
            return Delta(frame.text, self.attempt, frame.seq)
        if self.resuming and isinstance(frame, ErrorFrame) and frame.code == ErrorCode.overloaded:
            self.resuming = False
            raise ResumeLater(frame.retry_after_ms)
        self.end = frame
        return None

    def concerns(self, frame: Frame) -> bool:
        """True if `frame` belongs to this stream (by request_id, or by client_id early on)."""
        request_id = getattr(frame, "request_id", None)
        if isinstance(frame, AcceptedFrame):
            return frame.client_id == self.client_id
        if isinstance(frame, ErrorFrame) and request_id is None:
            # Refused before acceptance (its client_id), or about the socket itself.
            return frame.client_id in (None, self.client_id)
        return request_id is not None and request_id == self.request_id


def reconnect_order(urls: list[str], failed: str) -> list[str]:
    """Edges to try after `failed` dropped: the others first, in list order, then it again."""
    if failed not in urls:
        return list(urls)
    at = urls.index(failed)
    return urls[at + 1 :] + urls[:at] + [failed]
