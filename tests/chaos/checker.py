"""Judges what requesters saw: one final outcome per request, every `done` the engine's text.

Pure: histories in, verdicts and a table out; no I/O, no clock. A history is what one
requester saw of one acknowledged request, in arrival order:

- `websocket`: the server frames of the request across every socket it was read on
  (`chat.delta`, `chat.reset`, `chat.done`, `error`, `stream.resumed`). The edge has already
  applied the stream rules, so the client must see them kept exactly: any repeated `seq` is a
  duplicate, any hole a gap, a `chat.reset` only to a newer attempt.
- `kafka`: the result records on the producer's reply topic, in offset order. A consumer
  applies the documented rules itself (README "Writing requests straight to Kafka"): records
  of an older attempt than the newest seen are dropped (stale), a record identical to one
  already read at its `(attempt, seq)` is dropped (redelivered), a `reset` record starts the
  attempt it names if that is newer, and the first final ends the request: every record
  after it is dropped (ADR 0054); anything else that repeats or skips a `seq` is a fault.
  Records of a newer attempt after the final (a re-run of a request already answered) are
  counted as `rerun_after_final`: not shown, but work done twice.
- `openai-stream`: the SSE events an `openai` SDK stream read, across the connections it
  resumed on (`id: <attempt>:<seq>`), and what its requester did (`dropped`, `resumed`, an
  HTTP `status` that ended it). The edge applies the stream rules and SSE has no reset, so
  the text must come under one attempt, each `seq` once, then a `finish_reason`, then
  `[DONE]`; an `error` event is the request's outcome (`sse error <code>`).
- `openai`: a non-streaming call's whole `answer` (or the HTTP `status` that ended it).

Verdicts, per request:
- lost: no final outcome (`done` or `error`) at all;
- duplicated: a second final, a repeated delta, or a frame after the final (websocket: the
  edge applies the rules, so the client must never be shown any of these);
- corrupt: a gap, a delta that conflicts with one already read, a reset to an attempt not newer,
  an error code outside the protocol's stable codes, a `done` whose text is not the engine's,
  or (kafka) the answered attempt writing past its own final.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.messages import ErrorCode

Channel = Literal["websocket", "kafka", "openai-stream", "openai"]
CHANNELS: tuple[Channel, ...] = ("websocket", "kafka", "openai-stream", "openai")
OPENAI_CHANNELS = ("openai-stream", "openai")
STABLE_CODES = frozenset(code.value for code in ErrorCode)
# The SSE `error` event a draining edge ends a stream with at its bound: the stream goes on
# at another edge from the event it names, so it is no outcome (ADR 0073).
RESUMABLE_SSE_ERROR = "edge_restarting"


@dataclass(frozen=True)
class History:
    """What one requester saw of one acknowledged request (see the module docstring)."""

    request_id: str
    channel: Channel
    expected_text: str
    events: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class Verdict:
    request_id: str
    channel: Channel
    outcome: str | None  # "done", an error code, or None: lost
    duplicated: bool
    corrupt: bool
    problems: tuple[str, ...]
    redelivered: int = 0  # kafka: identical records a consumer drops by (attempt, seq)
    stale: int = 0  # kafka: records of a superseded attempt, dropped
    rerun_after_final: bool = False  # kafka: a newer attempt after the final, dropped

    @property
    def lost(self) -> bool:
        return self.outcome is None

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.corrupt)


@dataclass
class _Stream:
    """The requester's reading of one request so far."""

    expected_text: str
    attempt: int = 0
    next_seq: int = 0
    text: list[str] = field(default_factory=list)
    outcome: str | None = None
    final_id: tuple[int, int, str] | None = None  # (attempt, seq, kind) of the final record
    seen: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)
    duplicated: bool = False
    corrupt: bool = False
    problems: list[str] = field(default_factory=list)
    redelivered: int = 0
    stale: int = 0
    after_final: int = 0  # frames or records past the final: named once, then counted
    rerun_after_final: bool = False
    stable_codes: bool = True  # an error outcome must be a stable protocol code
    finish_reason: str | None = None  # openai-stream: the chunk that finished, read

    def duplicate(self, problem: str) -> None:
        self.duplicated = True
        self.problems.append(problem)

    def past_final(self, what: str) -> None:
        self.after_final += 1
        if self.after_final == 1:
            self.duplicate(f"{what} after the final ({self.outcome})")

    def listed_problems(self) -> tuple[str, ...]:
        more = self.after_final - 1
        extra = [f"{more} more after the final"] if more > 0 else []
        problems = tuple(self.problems + extra)
        return problems or (("no final outcome",) if self.outcome is None else ())

    def fault(self, problem: str) -> None:
        self.corrupt = True
        self.problems.append(problem)

    def shown(self, seq: int, text: str, what: str) -> None:
        """A delta shown to the client under the current attempt: the next `seq`, else a
        duplicate (an earlier one) or a gap (a later one)."""
        if seq < self.next_seq:
            self.duplicate(f"{what} shown again")
        elif seq > self.next_seq:
            self.fault(f"gap: {what}, {self.next_seq} due")
        else:
            self.next_seq = seq + 1
            self.text.append(text)

    def new_attempt(self, attempt: int) -> None:
        self.attempt, self.next_seq, self.text = attempt, 0, []

    def finish(self, outcome: str, final_id: tuple[int, int, str]) -> None:
        if self.outcome is not None:
            self.duplicate(f"a second final ({outcome}) after {self.outcome}")
            return
        self.outcome, self.final_id = outcome, final_id
        if outcome == "done":
            text = "".join(self.text)
            if text != self.expected_text:
                self.fault(_text_mismatch(text, self.expected_text, self.attempt))
        elif self.stable_codes and outcome not in STABLE_CODES:
            self.fault(f"error code {outcome!r} is not a stable protocol code")


def judge(history: History) -> Verdict:
    """The verdict on one request."""
    stream = _Stream(history.expected_text, stable_codes=history.channel not in OPENAI_CHANNELS)
    step = _STEPS[history.channel]
    for event in history.events:
        step(stream, event)
    return Verdict(
        request_id=history.request_id,
        channel=history.channel,
        outcome=stream.outcome,
        duplicated=stream.duplicated,
        corrupt=stream.corrupt,
        problems=stream.listed_problems(),
        redelivered=stream.redelivered,
        stale=stream.stale,
        rerun_after_final=stream.rerun_after_final,
    )


def _websocket_step(stream: _Stream, frame: Mapping[str, Any]) -> None:
    kind = frame.get("type")
    if kind == "chat.accepted":
        return
    if stream.outcome is not None:
        stream.past_final(str(kind))
        return
    if kind == "stream.resumed":
        shown = (int(frame["attempt"]), int(frame["after_seq"]))
        if shown != (stream.attempt, stream.next_seq - 1):
            stream.fault(
                f"stream.resumed at attempt {shown[0]} after seq {shown[1]}, but the client"
                f" had attempt {stream.attempt} up to seq {stream.next_seq - 1}"
            )
    elif kind == "chat.reset":
        attempt = int(frame["attempt"])
        if attempt <= stream.attempt:
            stream.fault(f"chat.reset to attempt {attempt}, not newer than {stream.attempt}")
        else:
            stream.new_attempt(attempt)
    elif kind == "chat.delta":
        seq = int(frame["seq"])
        stream.shown(seq, str(frame["text"]), f"delta seq {seq} of attempt {stream.attempt}")
    elif kind == "chat.done":
        stream.finish("done", (stream.attempt, stream.next_seq, "done"))
    elif kind == "error":
        stream.finish(str(frame.get("code")), (stream.attempt, stream.next_seq, "error"))
    else:
        stream.fault(f"unexpected frame type {kind!r}")


def _kafka_step(stream: _Stream, record: Mapping[str, Any]) -> None:
    attempt, seq, kind = int(record["attempt"]), int(record["seq"]), str(record["kind"])
    if kind == "reset":
        _kafka_reset(stream, attempt)
        return
    body = str(record.get("text") if kind == "delta" else record.get("code", ""))
    if stream.outcome is not None:
        assert stream.final_id is not None
        if (attempt, seq, kind) == stream.final_id or stream.seen.get((attempt, seq)) == (
            kind,
            body,
        ):
            stream.redelivered += 1
        elif attempt < stream.final_id[0]:
            stream.stale += 1
        elif attempt == stream.final_id[0]:
            # Dropped by the rule, but the answered attempt must never write past its final.
            stream.fault(f"{kind} of attempt {attempt} seq {seq} after its final")
        else:
            stream.rerun_after_final = True  # dropped by the rule: the first final ends it
        return
    if attempt < stream.attempt:
        stream.stale += 1
        return
    if attempt > stream.attempt:
        stream.new_attempt(attempt)
    if seq < stream.next_seq:
        if stream.seen.get((attempt, seq)) == (kind, body):
            stream.redelivered += 1
        else:
            stream.fault(f"{kind} of attempt {attempt} seq {seq} conflicts with the one read")
        return
    if seq > stream.next_seq:
        stream.fault(f"gap: {kind} seq {seq} of attempt {attempt}, {stream.next_seq} due")
        return
    stream.seen[(attempt, seq)] = (kind, body)
    stream.next_seq = seq + 1
    if kind == "delta":
        stream.text.append(body)
    elif kind == "done":
        stream.finish("done", (attempt, seq, kind))
    elif kind == "error":
        stream.finish(body, (attempt, seq, kind))
    else:
        stream.fault(f"unexpected record kind {kind!r}")


def _openai_stream_step(stream: _Stream, event: Mapping[str, Any]) -> None:
    """One SSE event (`id`, `data`) as the SDK client read it, or what its requester did
    (`dropped`, `resumed`, an HTTP `status` that ended it). There is no reset over SSE: text
    of another attempt than the one shown is corrupt."""
    if "status" in event:
        stream.finish(f"http {event['status']} {event.get('code')}", (stream.attempt, -1, "status"))
        return
    if "data" not in event:
        return  # dropped, resumed: how it was read, judged by what came
    data, event_id = event["data"], event.get("id")
    if stream.outcome is not None:
        if data == "[DONE]" and stream.outcome != "done" and stream.final_id == (-1, -1, "error"):
            stream.final_id = (-1, -1, "error [DONE]")  # the [DONE] an error event ends with
        else:
            stream.past_final(f"event {event_id} {str(data)[:60]}")
        return
    if data == "[DONE]":
        if stream.finish_reason is None:
            stream.fault("[DONE] before a chunk with a finish_reason")
        stream.finish("done", (stream.attempt, stream.next_seq, "done"))
        return
    if "error" in data:
        error = data["error"]
        if error.get("code") == RESUMABLE_SSE_ERROR:
            return  # a draining edge let go of it: the client goes on elsewhere (ADR 0073)
        stream.finish(f"sse error {error.get('code')}", (-1, -1, "error"))
        return
    choices = data.get("choices") or []
    if not choices:
        return  # the usage chunk
    choice, (attempt, seq) = choices[0], _event_id(event_id)
    if stream.finish_reason is not None:
        stream.duplicate(f"a chunk after the finish ({stream.finish_reason}): {event_id}")
        return
    if text := choice.get("delta", {}).get("content"):
        if stream.next_seq == 0:
            stream.attempt = attempt  # the attempt its text is shown under
        if attempt != stream.attempt:
            stream.fault(f"text of attempt {attempt} after attempt {stream.attempt}'s ({event_id})")
        else:
            stream.shown(seq, str(text), f"event {event_id}")
    if choice.get("finish_reason") is not None:
        stream.finish_reason = str(choice["finish_reason"])


def _event_id(value: object) -> tuple[int, int]:
    attempt, _, seq = str(value).partition(":")
    return int(attempt), int(seq)


def _openai_step(stream: _Stream, event: Mapping[str, Any]) -> None:
    """A non-streaming call's whole `answer`, its HTTP `status` error, or a resend."""
    if "answer" in event:
        stream.text = [str(event["answer"])]
        stream.finish("done", (0, 0, "done"))
    elif "status" in event:
        stream.finish(f"http {event['status']} {event.get('code')}", (0, 0, "error"))


def _kafka_reset(stream: _Stream, attempt: int) -> None:
    """`reset`: attempt `attempt` supersedes every earlier one; it carries no text or seq."""
    if stream.outcome is not None:
        assert stream.final_id is not None
        if attempt > stream.final_id[0]:
            stream.rerun_after_final = True  # dropped by the rule: the first final ends it
        else:
            stream.stale += 1
    elif attempt > stream.attempt:
        stream.new_attempt(attempt)
    else:
        stream.stale += 1  # announced already (by this reset or the attempt's own records)


def _text_mismatch(got: str, want: str, attempt: int) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if at is None:
        at = min(len(got), len(want))
    return (
        f"done, but attempt {attempt}'s text differs from the engine's at character {at}"
        f" ({len(got)} characters shown, {len(want)} expected)"
    )


@dataclass(frozen=True)
class Summary:
    """The counts of one run, for one channel or all of them."""

    acknowledged: int
    done: int
    errors: Mapping[str, int]
    lost: int
    duplicated: int
    corrupt: int
    redelivered: int = 0
    stale: int = 0
    rerun_after_final: int = 0  # kafka: requests run again after they were answered

    @property
    def passed(self) -> bool:
        return self.acknowledged > 0 and self.lost == self.duplicated == self.corrupt == 0


_STEPS = {
    "websocket": _websocket_step,
    "kafka": _kafka_step,
    "openai-stream": _openai_stream_step,
    "openai": _openai_step,
}


def summarize(verdicts: Iterable[Verdict]) -> Summary:
    verdicts = list(verdicts)
    errors = Counter(v.outcome for v in verdicts if v.outcome not in (None, "done"))
    return Summary(
        acknowledged=len(verdicts),
        done=sum(v.outcome == "done" for v in verdicts),
        errors={str(code): n for code, n in sorted(errors.items(), key=lambda kv: str(kv[0]))},
        lost=sum(v.lost for v in verdicts),
        duplicated=sum(v.duplicated for v in verdicts),
        corrupt=sum(v.corrupt for v in verdicts),
        redelivered=sum(v.redelivered for v in verdicts),
        stale=sum(v.stale for v in verdicts),
        rerun_after_final=sum(v.rerun_after_final for v in verdicts),
    )


def table(verdicts: Iterable[Verdict]) -> str:
    """A Markdown table: one row per channel and the total."""
    verdicts = list(verdicts)
    rows: list[tuple[str, Summary]] = [
        (c, summarize(v for v in verdicts if v.channel == c)) for c in CHANNELS
    ]
    rows.append(("all", summarize(verdicts)))
    head = (
        "| channel | acknowledged | done | errors by code | lost | duplicated | corrupt"
        " | redelivered records | stale records | re-run after the final |\n"
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for name, s in rows:
        errors = ", ".join(f"{code}: {n}" for code, n in s.errors.items()) or "0"
        lines.append(
            f"| {name} | {s.acknowledged} | {s.done} | {errors} | {s.lost} | {s.duplicated}"
            f" | {s.corrupt} | {s.redelivered} | {s.stale} | {s.rerun_after_final} |"
        )
    return "\n".join(lines)


def failures(verdicts: Iterable[Verdict], limit: int = 20) -> str:
    """The first `limit` failed verdicts, one line each, for an assertion message."""
    bad = [v for v in verdicts if not v.ok]
    lines = [f"{v.channel} {v.request_id}: {'; '.join(v.problems)}" for v in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"... and {len(bad) - limit} more")
    return "\n".join(lines)
