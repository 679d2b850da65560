"""The SDK's framing rules (tokenbus/client/framing.py), pure: no socket, no broker.

The property test plays the edge with its own pure StreamRouter over a result log holding
re-runs, duplicates and late records of old attempts; the client's socket drops at random
points (frames in flight are lost) and it resumes from what it showed. Whatever happens,
the caller is shown the final attempt's text exactly once, in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.edge.protocol import (
    AcceptedFrame,
    DeltaFrame,
    DoneFrame,
    ErrorFrame,
    ResetFrame,
    ServerFrame,
    StreamResumedFrame,
)
from services.edge.streams import ResumePoint, StreamRouter
from shared.messages import (
    DeltaResult,
    DoneResult,
    ErrorCode,
    ResetResult,
    Tier,
    Timings,
    Usage,
)
from tokenbus.client.framing import (
    Delta,
    ResumeLater,
    StreamBroken,
    StreamState,
    parse_frame,
    reconnect_order,
)

RID = "r1"
USAGE = Usage(prompt_tokens=1, completion_tokens=1)
TIMINGS = Timings(queue_ms=0, batch_size=1, ttft_ms=1, total_ms=1)
Result = DeltaResult | DoneResult | ResetResult


def accepted_state() -> StreamState:
    state = StreamState(client_id="c1")
    state.receive(
        AcceptedFrame(request_id=RID, client_id="c1", resume_token="tok", tier=Tier.interactive)
    )
    return state


def delta(seq: int, text: str = "x") -> DeltaFrame:
    return DeltaFrame(request_id=RID, seq=seq, text=text)


def done() -> DoneFrame:
    return DoneFrame(request_id=RID, finish_reason="stop", usage=USAGE, timings=TIMINGS)


# -- the rules, one by one -----------------------------------------------------------------


def test_acceptance_gives_the_request_id_and_the_resume_point_starts_before_seq_0() -> None:
    state = accepted_state()
    assert state.request_id == RID
    assert state.resume_frame() == {
        "type": "stream.resume",
        "resume_token": "tok",
        "after_seq": -1,
        "attempt": 0,
    }


def test_a_replayed_delta_is_dropped_and_the_next_is_shown() -> None:
    state = accepted_state()
    assert state.receive(delta(0, "a")) == Delta("a", 0, 0)
    assert state.receive(delta(0, "a")) is None
    assert state.receive(delta(1, "b")) == Delta("b", 0, 1)
    assert state.text == "ab"


def test_a_hole_in_seq_is_a_broken_stream_never_shown() -> None:
    state = accepted_state()
    state.receive(delta(0))
    with pytest.raises(StreamBroken):
        state.receive(delta(2))
    assert state.text == "x"


def test_a_reset_of_a_newer_attempt_restarts_the_text_and_seq() -> None:
    state = accepted_state()
    state.receive(delta(0, "old"))
    assert state.receive(ResetFrame(request_id=RID, attempt=1)) == Delta("", 1, -1, reset=True)
    assert state.text == ""
    assert state.receive(delta(0, "new")) == Delta("new", 1, 0)
    assert state.resume_frame()["attempt"] == 1
    assert state.resume_frame()["after_seq"] == 0
    assert state.receive(ResetFrame(request_id=RID, attempt=1)) is None, "already shown"
    assert state.text == "new"


def test_a_frame_with_a_field_a_newer_edge_added_is_read() -> None:
    newer = delta(0, "hi").model_dump() | {"added_later": 1}
    assert parse_frame(json.dumps(newer)) == delta(0, "hi")  # ADR 0072


def test_stream_resumed_must_name_the_point_resumed_from() -> None:
    state = accepted_state()
    state.receive(delta(0))
    state.resume_frame()
    with pytest.raises(StreamBroken):
        state.receive(StreamResumedFrame(request_id=RID, attempt=0, after_seq=-1))
    state.receive(StreamResumedFrame(request_id=RID, attempt=0, after_seq=0))
    assert not state.resuming


def test_overloaded_in_answer_to_a_resume_is_resume_later_not_the_end() -> None:
    state = accepted_state()
    state.resume_frame()
    busy = ErrorFrame(code=ErrorCode.overloaded, message="try", request_id=RID, retry_after_ms=9)
    with pytest.raises(ResumeLater) as later:
        state.receive(busy)
    assert later.value.retry_after_ms == 9
    assert not state.finished
    # Outside a resume, it is the stream's end like any error.
    state.receive(busy)
    assert state.end == busy


def test_nothing_is_shown_after_the_end() -> None:
    state = accepted_state()
    state.receive(done())
    assert state.finished
    assert state.receive(delta(0)) is None
    assert state.receive(ResetFrame(request_id=RID, attempt=3)) is None
    assert state.text == ""


def test_frames_are_matched_by_client_id_before_acceptance_then_by_request_id() -> None:
    state = StreamState(client_id="c1")
    other = AcceptedFrame(request_id="r2", client_id="c2", resume_token="t", tier=Tier.background)
    assert not state.concerns(other)
    assert state.concerns(ErrorFrame(code=ErrorCode.rate_limited, message="m", client_id="c1"))
    assert state.concerns(ErrorFrame(code=ErrorCode.unauthorized, message="m"))
    assert not state.concerns(delta(0)), "no request id known yet"
    state = accepted_state()
    assert state.concerns(delta(0))
    assert not state.concerns(DeltaFrame(request_id="r2", seq=0, text="x"))
    with pytest.raises(ValueError, match="nothing to resume"):
        StreamState(client_id="c").resume_frame()


def test_server_frames_parse_by_their_type() -> None:
    frame = parse_frame('{"type": "chat.delta", "request_id": "r1", "seq": 3, "text": "hi"}')
    assert frame == delta(3, "hi")


def test_reconnect_tries_the_other_edges_first_then_the_one_that_dropped() -> None:
    assert reconnect_order(["a", "b", "c"], "b") == ["c", "a", "b"]
    assert reconnect_order(["a"], "a") == ["a"]
    assert reconnect_order(["a", "b"], "z") == ["a", "b"]


# -- the property: any log, any drops, the final text once ---------------------------------


@dataclass
class Log:
    records: list[Result]
    final_text: list[str]  # the deltas of the final attempt, in seq order


@st.composite
def result_logs(draw: st.DrawFn) -> Log:
    attempts = draw(st.integers(1, 3))
    texts = [
        draw(st.lists(st.text("abc ", min_size=1, max_size=3), max_size=6)) for _ in range(attempts)
    ]
    records: list[Result] = []
    late: list[Result] = []  # old attempts' records written after the next attempt began
    for attempt, pieces in enumerate(texts):
        if attempt > 0:
            records.append(ResetResult(request_id=RID, attempt=attempt, seq=0))
            records.extend(late)
            late = []
        deltas = [
            DeltaResult(request_id=RID, attempt=attempt, seq=seq, text=text)
            for seq, text in enumerate(pieces)
        ]
        if attempt < attempts - 1:
            split = draw(st.integers(0, len(deltas)))
            records.extend(deltas[:split])
            late = deltas[split:]
        else:
            records.extend(deltas)
            end = {"finish_reason": "stop", "usage": USAGE, "timings": TIMINGS}
            records.append(DoneResult(request_id=RID, attempt=attempt, seq=len(deltas), **end))
    # Duplicates (a producer's retry, a replay): a copy of an earlier record, anywhere later.
    for _ in range(draw(st.integers(0, 6))):
        source = draw(st.integers(0, len(records) - 1))
        at = draw(st.integers(source + 1, len(records)))
        records.insert(at, records[source])
    return Log(records, texts[-1])


class _Socket:
    """One connection's frames as the edge's router sends them (a stand-in client)."""

    def __init__(self) -> None:
        self.frames: list[ServerFrame] = []

    def send(self, frame: ServerFrame, stream: object | None = None) -> None:
        self.frames.append(frame)


@given(log=result_logs(), data=st.data())
@settings(max_examples=300, deadline=None)
def test_through_any_drops_and_resumes_the_final_text_is_shown_once(
    log: Log, data: st.DataObject
) -> None:
    router = StreamRouter()
    state = StreamState(client_id="c1")
    shown: list[Delta] = []
    seen_upto = 0  # how far into the log the edge had read when the last socket dropped
    drops = data.draw(st.integers(0, 4), label="drops")
    for connection in range(drops + 1):
        last = connection == drops
        owner = _Socket()
        frames = owner.frames
        if connection == 0:
            router.open(RID, owner)
            accepted = AcceptedFrame(
                request_id=RID, client_id="c1", resume_token="tok", tier=Tier.interactive
            )
            router.release(RID, accepted)
            start = 0
        else:
            resume = state.resume_frame()
            point = ResumePoint(resume["attempt"], resume["after_seq"])
            router.resume(RID, owner, point)
            # The edge replays from the stream's first record to the log end of the moment
            # of the resume (at least as far as the client can have seen), then goes live.
            log_end = data.draw(st.integers(seen_upto, len(log.records)), label="log end")
            for record in log.records[:log_end]:
                router.route(record)
            assert router.caught_up(RID), "the client never claims more than the log held"
            start = log_end
        cut = (
            len(log.records)
            if last
            else data.draw(st.integers(start, len(log.records)), label="drop at")
        )
        for record in log.records[start:cut]:
            router.route(record)
        seen_upto = max(seen_upto, cut)
        # Frames in flight when the socket drops never arrive. (A drop before the acceptance
        # arrives is not a resume: the SDK sends the request again.)
        at_least = 1 if connection == 0 else 0
        arrived = frames if last else frames[: data.draw(st.integers(at_least, len(frames)))]
        for frame in arrived:
            if state.concerns(frame):
                d = state.receive(frame)
                if d is not None:
                    shown.append(d)
        if not last:
            router.detach(owner)
    assert isinstance(state.end, DoneFrame), state.end
    # What the caller saw, with resets applied, is the final attempt's text, once.
    text = ""
    for d in shown:
        text = "" if d.reset else text + d.text
    assert text == "".join(log.final_text) == state.text
    # Since the last reset, every seq once, in order. (A new attempt whose text begins with
    # what was shown goes on under the attempt shown, its seq counting on: ADR 0071.)
    final_attempt = shown[-1].attempt if shown else 0
    seqs = [d.seq for d in shown if d.attempt == final_attempt and not d.reset]
    assert seqs == list(range(len(seqs)))
